"""Build the engine's C++ CPU kernels (`make` runs this; so can a user): one shared library of torch
custom ops, compiled against the installed torch with the system's g++, for this machine's CPU
(-march=native: the library is built where it runs, like the venv).

    python -m engine.kernels.build            # -> engine/kernels/_morphserve_kernels.so

It registers the ops with torch's dispatcher (TORCH_LIBRARY), so Python loads it with
torch.ops.load_library and needs no Python headers or pybind11."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from torch.utils import cpp_extension

from engine.kernels import LIBRARY, SOURCES


def command(output: Path = LIBRARY) -> list[str]:
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib_dirs = cpp_extension.library_paths()
    abi = int(torch.compiled_with_cxx11_abi())
    return [os.environ.get("CXX", "g++"), "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-std=c++20", "-shared", "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *map(str, SOURCES), "-o", str(output),
            *[f"-L{d}" for d in lib_dirs], *[f"-Wl,-rpath,{d}" for d in lib_dirs], "-lc10", "-ltorch_cpu", "-ltorch"]


def build(output: Path = LIBRARY) -> Path | None:
    """The library, or None (said on stderr) when there is no C++ compiler: the engine then runs its
    torch-only paths, so a machine without g++ still serves, only slower."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        print(f"no C++ compiler ({os.environ.get('CXX', 'g++')}): skipping the engine's CPU kernels "
              "(decode attention falls back to gathering the KV blocks)", file=sys.stderr)
        return None
    tmp = output.with_suffix(".so.tmp")  # a concurrent import never sees a half-written library
    cmd = command(tmp)
    print(" ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True)
    tmp.replace(output)
    return output


if __name__ == "__main__":
    if (built := build()) is not None:
        print(f"built {built} (python {sysconfig.get_python_version()}, torch {torch.__version__})", file=sys.stderr)
