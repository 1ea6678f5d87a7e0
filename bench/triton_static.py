"""Ahead-of-time Triton compiles for a named GPU on a host without one: the launches an op makes,
their cold compile time, and what ptxas and the SASS say about each kernel.

Triton compiles for any target with no GPU present (ptxas, nvdisasm ship with Triton), so a
kernel's registers, spills and instruction mix can be read, and variants compared, on a CPU host.
"""

import collections
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import triton
from triton.compiler import ASTSource

NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                 torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}


def recorded_launches(ops_module: ModuleType, run: Callable[[], object],
                      launch: bool = False) -> list[tuple]:
    """(kernel, grid, positional args, keyword args) of every launch run() makes through
    ops_module.wrap_triton, recorded instead of launched (CPU tensors will do), or with `launch`
    also launched, so each launch's inputs hold what the earlier ones wrote."""
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def record(*args, **kwargs):
                launches.append((self.kernel, grid, args, kwargs))
                if launch:
                    self.kernel[grid](*args, **kwargs)

            return record

    original = ops_module.wrap_triton
    ops_module.wrap_triton = Recorder
    try:
        run()
    finally:
        ops_module.wrap_triton = original
    return launches


def source(kernel, args: tuple, kwargs: dict) -> tuple[ASTSource, dict]:
    """The kernel's ASTSource with the launcher's argument types, and its compile options."""
    names = kernel.arg_names
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(names, args, strict=False)) | kwargs
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        value = values[name]
        aligned = False
        if kernel.params[i].is_constexpr or value is None:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_DTYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32"
            aligned = value % 16 == 0
        else:
            signature[name] = "fp32"
        # The launcher marks 16-byte-aligned pointers and ints divisible by 16 (vectorized
        # loads, shared address arithmetic); unmarked, registers read up to 2x high.
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs), options


def resource_usage(ptx: str, arch: int) -> dict[str, int]:
    """ptxas -v's registers a thread and spill bytes (stores + loads) for the PTX's kernel."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as file:
        file.write(ptx)
        file.flush()
        ptxas = str(NVIDIA_BIN / "ptxas")
        command = [ptxas, f"-arch=sm_{arch}a", "-v", file.name, "-o", os.devnull]
        log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(registers.group(1)) if registers else -1,
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else -1}


def sass_opcodes(cubin: bytes) -> collections.Counter:
    """How many times each SASS opcode (without modifiers: `REDUX`, `BAR`, `ISETP`) appears in
    the cubin's code. Loops are counted once, so for a kernel without runtime loops this is the
    instructions each warp issues."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        listing = subprocess.run([str(NVIDIA_BIN / "nvdisasm"), "-c", file.name],
                                 capture_output=True, text=True, check=True).stdout
    opcode = re.compile(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
    return collections.Counter(m.group(1) for m in map(opcode.match, listing.splitlines()) if m)
