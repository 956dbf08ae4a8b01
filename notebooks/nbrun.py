"""Runs a notebook as a fresh Jupyter kernel would, without Jupyter, and compares its outputs.

Used by make_walkthroughs.py (which writes the outputs the repository commits) and by
tests/test_notebooks.py (which runs every notebook again and compares), so that both see the same
kind of run:

- each notebook runs in a fresh Python process (``python nbrun.py IN OUT``), in its own folder, with
  the repository first on the path, ``PYTHONHASHSEED=0``, 2 threads (``OMP_NUM_THREADS``, so that
  sums split across threads add up alike on any machine), matplotlib's Agg backend, and no
  environment variable that changes what is printed (``COLUMNS``, ``TORCH_LOGS``, ``TORCHFUSER_*`` …);
- a code cell's outputs are what a kernel records: its stdout and stderr (Python's and the C
  libraries'), the value of a last bare expression, every open matplotlib figure as a PNG, or the
  error that stopped the run;
- :func:`normalise` takes the machine out of the text: the repository's, the Python installation's,
  the home and the temporary folder's paths, the host name, and timestamps.

The check (:func:`differences`) compares every output's text exactly, except timings (see
:func:`mask_timings`) and the bytes of images (a PNG depends on the matplotlib and FreeType that drew
it, and the notebooks' plots are of timings): an image is compared by its type and its text.
"""
from __future__ import annotations

import ast
import base64
import difflib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REGENERATE = "python notebooks/make_walkthroughs.py"
# The kernel's thread count: fixed, so that the fp32 sums (and the printed losses) do not depend on
# the machine's number of cores.
THREADS = 2
# Set by a user or by CI, and each changes what a notebook prints.
_DROP_ENV = ("COLUMNS", "LINES", "PYTHONWARNINGS", "TORCH_LOGS", "TORCHDYNAMO_VERBOSE", "TRANSFORMERS_VERBOSITY",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS", "TORCHFUSER_MLIR_DUMP", "TORCHFUSER_MLIR_THREADS",
             "TORCHFUSER_COMPILED_ELEMENTWISE", "MPLBACKEND", "TQDM_DISABLE")


# --- timings --------------------------------------------------------------------------------------

_NUMBER = r"(?<![\w.,])[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?"
# A number followed by a unit of time or of rate ("44.7 ms", "5,722 tokens/s", "3 s/it"), or by a
# bare "x" (a speed-up, "1.36x"; "4 x 64" and "500x220" are no speed-ups).
_TIMING = re.compile(
    r"([ \t]*)(?:" + _NUMBER + r"(?=\s?(?:ns|us|µs|ms|s|sec|min|it/s|s/it|tokens/s|tok/s|samples/s|steps/s)(?![\w/]))"
    + "|" + _NUMBER + r"(?=x(?!\w)))")


def mask_timings(text: str) -> str:
    """``text`` with every timing replaced by ``<t>``: what differs from run to run and nothing else.

    The padding before a timing goes with it (a right-aligned "  44.7 ms" and " 132.5 ms" mask alike).
    """
    return _TIMING.sub(lambda m: (" " if m.group(1) else "") + "<t>", text)


# --- machine paths, host, dates -----------------------------------------------------------------

def _machine_prefixes() -> list[tuple[str, str]]:
    import site
    import socket
    import sysconfig
    pairs = [(str(REPO), "<repo>")]
    sp = set(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    sp |= {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], site.getusersitepackages()}
    pairs += [(p, "<site-packages>") for p in sp]
    pairs += [(sysconfig.get_paths()["stdlib"], "<stdlib>"), (sys.prefix, "<python>"), (sys.base_prefix, "<python>"),
              (tempfile.gettempdir(), "<tmp>"), (os.path.expanduser("~"), "~")]
    for p in list(pairs):  # the same folders as the resolved paths a traceback may show
        real = os.path.realpath(p[0])
        if real != p[0]:
            pairs.append((real, p[1]))
    # Only folders two deep or deeper ("/usr" or "/" alone would also match text that is no path of ours).
    pairs = [(p.rstrip("/"), r) for p, r in pairs if p and len(Path(p).parts) >= 2 and p not in ("/usr", "/opt")]
    pairs.sort(key=lambda pr: -len(pr[0]))
    host = socket.gethostname()
    return pairs + ([(host, "<host>")] if len(host) >= 3 else [])


_PREFIXES: list[tuple[re.Pattern, str]] | None = None
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?")


def normalise(text: str) -> str:
    """``text`` without this machine in it: its paths, host name and timestamps replaced by placeholders."""
    global _PREFIXES
    if _PREFIXES is None:
        _PREFIXES = [(re.compile(r"(?<![\w.-])" + re.escape(p) + r"(?![\w.-])"), r) for p, r in _machine_prefixes()]
    for pattern, placeholder in _PREFIXES:
        text = pattern.sub(placeholder, text)
    return _DATE.sub("<date>", text)


# --- running (the parent) ----------------------------------------------------------------------------

def versions() -> dict:
    """What a notebook's outputs depend on besides the repository: recorded with them, compared before them."""
    from importlib import metadata

    def version(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    return {"python": "%d.%d" % sys.version_info[:2], "torch": (version("torch") or "").split("+")[0],
            "transformers": version("transformers"), "torch-mlir": version("torch-mlir"), "threads": THREADS}


def execute(path: Path, timeout: float = 900) -> dict:
    """The notebook at ``path`` with its code cells run, in order, in a fresh process; outputs normalised.

    A cell that raises ends the run: its output is the error, the cells after it have none.
    """
    path = Path(path).resolve()
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
               PYTHONHASHSEED="0", OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS),
               MPLBACKEND="Agg", PYTHONIOENCODING="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / path.name
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(path), str(out)], cwd=path.parent,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"running {path.name} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
        nb = json.loads(out.read_text())
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            _map_text(o, normalise)
    nb["metadata"]["executed_with"] = versions()
    return nb


def _map_text(output: dict, f) -> dict:
    """Applies ``f`` to every text of ``output`` in place (not to images)."""
    if output["output_type"] == "stream":
        output["text"] = _lines(f("".join(output["text"])))
    elif output["output_type"] == "error":
        output["evalue"] = f(output["evalue"])
        output["traceback"] = [f(t) for t in output["traceback"]]
    else:
        for mime, value in output.get("data", {}).items():
            if mime.startswith("text/") or mime.endswith("json"):
                output["data"][mime] = _lines(f("".join(value) if isinstance(value, list) else value))
    return output


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def first_error(nb: dict) -> str | None:
    """The traceback of the error that stopped the run, or None."""
    for cell in nb["cells"]:
        for o in cell.get("outputs", []):
            if o["output_type"] == "error":
                return f"cell {cell.get('id')}:\n" + "\n".join(o["traceback"])
    return None


def write(path: Path, nb: dict) -> None:
    """Writes ``nb`` as Jupyter does (sorted keys, one-space indent), so that a rewrite changes no byte."""
    Path(path).write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n")


# --- comparing -------------------------------------------------------------------------------------------

def render(nb: dict) -> list[str]:
    """The outputs of ``nb`` as lines of text, as the check compares them (timings masked, images by type).

    Every line starts with its cell's id, so that a diff names the cell.
    """
    lines = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        cell_lines = ["(cell)\n"]
        for o in cell.get("outputs", []):
            o = _map_text(json.loads(json.dumps(o)), lambda t: mask_timings(normalise(t)))
            kind = o["output_type"]
            if kind == "stream":
                cell_lines += [f"--- {o['name']}\n", *o["text"]]
            elif kind == "error":
                cell_lines += ["--- error\n", f"{o['ename']}: {o['evalue']}\n"]
            else:
                for mime in sorted(o["data"]):
                    value = o["data"][mime]
                    if mime.startswith("image/"):
                        cell_lines.append(f"--- {kind} {mime} (an image: not compared byte by byte)\n")
                    else:
                        cell_lines += [f"--- {kind} {mime}\n", *(value if isinstance(value, list) else _lines(value))]
            if not cell_lines[-1].endswith("\n"):
                cell_lines[-1] += "\n"
        lines += [f"[{cell.get('id')}] {line}" for line in cell_lines]
    return lines


def differences(committed: dict, fresh: dict) -> str:
    """A unified diff of the two notebooks' outputs as :func:`render` shows them; empty when they agree."""
    return "".join(difflib.unified_diff(render(committed), render(fresh), "committed", "fresh run", n=2))


def environment_differs(committed: dict) -> str | None:
    """Why this environment cannot reproduce ``committed``'s outputs (another torch, transformers, no torch-mlir), or None.

    Raises ValueError for a notebook that records no versions: its outputs were not made by make_walkthroughs.py.
    """
    then, now = committed.get("metadata", {}).get("executed_with"), versions()
    if then is None:
        raise ValueError(f"the notebook records no versions (metadata.executed_with): regenerate it ({REGENERATE})")
    keys = ("torch", "transformers", "torch-mlir", "threads")
    if any(then.get(k) != now.get(k) for k in keys):
        return (f"outputs were made with {', '.join(f'{k} {then.get(k)}' for k in keys)}; this environment has "
                f"{', '.join(f'{k} {now.get(k)}' for k in keys)}")
    return None


# --- the kernel (the child process) ----------------------------------------------------------------------

class _Kernel:
    def __init__(self):
        self.outputs: list[dict] = []
        self.count = 0

    def stream(self, name: str, text: str) -> None:
        if self.outputs and self.outputs[-1]["output_type"] == "stream" and self.outputs[-1]["name"] == name:
            self.outputs[-1]["text"] += text
        else:
            self.outputs.append({"output_type": "stream", "name": name, "text": text})

    def bundle(self, obj) -> dict:
        data = {}
        for mime, method in (("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"),
                             ("image/png", "_repr_png_"), ("text/latex", "_repr_latex_")):
            value = getattr(obj, method, None)
            value = value() if callable(value) else None
            if value is not None:
                data[mime] = base64.b64encode(value).decode() + "\n" if isinstance(value, bytes) else value
        data["text/plain"] = repr(obj)
        return data

    def display(self, *objs) -> None:
        for obj in objs:
            self.outputs.append({"output_type": "display_data", "data": self.bundle(obj), "metadata": {}})

    def figures(self) -> None:
        """Each open matplotlib figure as a PNG, then closed: what Jupyter's inline backend does after a cell."""
        if "matplotlib.pyplot" not in sys.modules:
            return
        import matplotlib.pyplot as plt
        for num in plt.get_fignums():
            fig = plt.figure(num)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", bbox_inches="tight", metadata={"Software": None})
            self.outputs.append({"output_type": "display_data", "metadata": {},
                                 "data": {"image/png": base64.b64encode(buf.getvalue()).decode() + "\n",
                                          "text/plain": repr(fig)}})
        plt.close("all")

    def run(self, source: str, ns: dict) -> bool:
        """Runs one cell; False when it raised (its error is its last output)."""
        import linecache
        import traceback
        self.count += 1
        filename = f"<cell In[{self.count}]>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        try:
            tree = ast.parse(source, filename)
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
                last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, filename, "exec"), ns)
            if last is not None:
                value = eval(compile(last, filename, "eval"), ns)
                if value is not None:
                    self.outputs.append({"output_type": "execute_result", "execution_count": self.count,
                                         "data": self.bundle(value), "metadata": {}})
            return True
        except BaseException as e:  # noqa: BLE001 - a kernel reports whatever a cell raises
            tb = e.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next  # the cell's frames, not the kernel's
            self.outputs.append({"output_type": "error", "ename": type(e).__name__, "evalue": str(e),
                                 "traceback": traceback.format_exception(type(e), e, tb)})
            return False
        finally:
            self.figures()


class _Out(io.TextIOBase):
    """sys.stdout / sys.stderr of the kernel: what is written goes to the running cell's outputs."""
    encoding = "utf-8"
    errors = "strict"

    def __init__(self, kernel: _Kernel, name: str, fd: int):
        self.kernel, self.name, self.fd = kernel, name, fd

    def write(self, s: str) -> int:
        if s:
            self.kernel.stream(self.name, s)
        return len(s)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:  # writes to the descriptor are caught too (below)
        return self.fd


def _kernel_main(src: str, dst: str) -> None:
    import ctypes
    import types
    nb = json.loads(Path(src).read_text())
    kernel = _Kernel()
    # What C code (or a subprocess) writes to the descriptors 1 and 2 goes to files, read after each cell.
    saved_err = os.dup(2)
    files = {}
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = tempfile.TemporaryFile()
        os.dup2(f.fileno(), fd)
        files[name] = f
    libc = ctypes.CDLL(None)
    # Replaced before the notebook imports anything, so that the logging handlers it creates write here.
    sys.stdout, sys.stderr = _Out(kernel, "stdout", 1), _Out(kernel, "stderr", 2)
    main = types.ModuleType("__main__")  # as IPython: the cells' globals are a module sys.modules knows
    main.__dict__.update(__builtins__=__builtins__, display=kernel.display)
    sys.modules["__main__"] = main
    sys.argv = [""]
    failed = False
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        cell["metadata"].pop("execution", None)
        cell["outputs"], cell["execution_count"] = [], None
        if failed:
            continue
        kernel.outputs = []
        failed = not kernel.run("".join(cell["source"]), main.__dict__)
        libc.fflush(None)
        for name, f in files.items():
            data = f.read()  # from where the last cell's reading stopped, to the end
            if data:  # after the cell's other outputs: the order between the two is not known
                kernel.stream(name, data.decode("utf-8", "replace"))
        for o in kernel.outputs:
            if o["output_type"] == "stream":
                o["text"] = _lines(o["text"])
            for mime, value in o.get("data", {}).items():
                if not mime.startswith("image/"):
                    o["data"][mime] = _lines(value)
        cell["outputs"], cell["execution_count"] = kernel.outputs, kernel.count
    sys.stdout, sys.stderr = sys.__stdout__, os.fdopen(saved_err, "w")
    write(Path(dst), nb)


if __name__ == "__main__":
    _kernel_main(sys.argv[1], sys.argv[2])
