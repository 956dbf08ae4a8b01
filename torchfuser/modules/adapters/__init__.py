"""Adapters inside the fused blocks: PEFT LoRA layers run as one autograd node per projection group
(``lora``), over plain or quantised bases (``quantized_base``: bitsandbytes NF4 / FP4 / int8,
dequantised per GEMM). The fused modules reach them through ``modules.projections``."""
