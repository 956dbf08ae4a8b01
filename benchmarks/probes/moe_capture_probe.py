"""Which piece of the MoE reference backend can be captured in a CUDA graph: each backend function on its
own, bf16, at a small shape (run on the GPU; "ok" or the first line of the error per piece).

    python3 benchmarks/probes/moe_capture_probe.py
"""
import sys

import torch

sys.path.insert(0, ".")
from torchfuser.backends.reference import moe as R, grouped_mm as G
from torchfuser.backends.reference._autodiff import value_and_vjp
dev="cuda"; T,H,I,E,k=512,256,128,8,2
x=torch.randn(T,H,device=dev,dtype=torch.bfloat16); l=torch.randn(T,E,device=dev)
gu=torch.randn(E,2*I,H,device=dev,dtype=torch.bfloat16); dn=torch.randn(E,H,I,device=dev,dtype=torch.bfloat16)
def cap(name, fn):
    s=torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g=torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g): fn()
        g.replay(); torch.cuda.synchronize(); print(name, "ok", flush=True)
    except Exception as e:
        print(name, "FAIL", str(e).splitlines()[0][:150], flush=True); torch.cuda.synchronize()
w,idx=R.moe_route_fwd(l,None,k,"softmax",True,1,1,2,1.0)
order,offs=G.sort_by_expert(idx,E)
cap("sort", lambda: torch.sort(idx.reshape(-1), stable=True))
cap("searchsorted", lambda: G.sort_by_expert(idx,E))
cap("route", lambda: R.moe_route_fwd(l,None,k,"softmax",True,1,1,2,1.0))
xs=x[order//k]
cap("gmm_rows", lambda: torch._grouped_mm(xs, gu.transpose(1,2), offs=offs))
dh=torch.randn(T*k,2*I,device=dev,dtype=torch.bfloat16)
cap("gmm_k", lambda: torch._grouped_mm(dh.t(), xs, offs=offs))
cap("experts_fwd", lambda: R.moe_experts_fwd(x,w,idx,gu,None,dn,None,False,"gate_up","silu",1.0,0.0,torch.float32))
y,h,o2,of2=R.moe_experts_fwd(x,w,idx,gu,None,dn,None,False,"gate_up","silu",1.0,0.0,torch.float32)
dy=torch.randn(T,H,device=dev)
cap("act_vjp", lambda: value_and_vjp(R.activation, (h,), h[:, :I].contiguous(), "gate_up", "silu", 1.0, 0.0))
cap("experts_bwd", lambda: R.moe_experts_bwd(dy,x,w,idx,gu,None,dn,None,h,o2,of2,False,"gate_up","silu",1.0,0.0))
cap("route_bwd", lambda: R.moe_route_bwd(torch.ones_like(w),l,idx,"softmax",True,1.0))
