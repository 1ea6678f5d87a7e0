"""Grouped matrix product over contiguous row groups.

    out[m] = x[m] @ w[e]   for start_e <= m < offs[e],  start_0 = 0, start_e = offs[e-1]
    out[m] = 0             for m >= offs[E-1]  (padding rows)

On sm90+ CUDA with bf16 activations this is one `torch._grouped_mm` call. Elsewhere (CPU,
float32/float64, older GPUs) there are two exact fallbacks:
- eager: one GEMM per expert over its own row slice (reads the group ends on the host);
- under torch.compile: every expert's product over all rows, each row keeping its own expert's
  result. E times the FLOPs, but no host sync and no data-dependent shapes, so it traces with
  fullgraph=True; meant for debug sizes and tests.
"""

import torch


def _use_cuda_grouped_mm(x: torch.Tensor) -> bool:
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        return False
    # get_device_properties is constant-folded by dynamo, so this stays a static branch.
    return torch.cuda.get_device_properties(x.device).major >= 9


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Exact, compile-friendly grouped product: E dense GEMMs, each row picks its expert's."""
    rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
    # Row m belongs to the first group whose end exceeds m; rows past offs[-1] get E (none).
    expert_of_row = torch.searchsorted(offs, rows, right=True).unsqueeze(-1)
    out = x.new_zeros(x.shape[0], w.shape[-1])
    for e in range(w.shape[0]):
        out = torch.where(expert_of_row == e, x @ w[e], out)
    return out


def grouped_mm_sliced(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Exact grouped product, one GEMM per group; eager only (offs is read on the host)."""
    outs, start = [], 0
    for e, end in enumerate(offs.tolist()):
        outs.append(x[start:end] @ w[e])
        start = end
    outs.append(x.new_zeros(x.shape[0] - start, w.shape[-1]))
    return torch.cat(outs)


def grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, zero_padding_rows: bool = True
) -> torch.Tensor:
    """x [M, in], w [E, in, out], offs [E] int32 cumulative group ends -> [M, out] in x's dtype.

    torch._grouped_mm leaves output rows past offs[-1] uninitialised (NaN garbage seen on torch
    2.11 / H200), and its backward writes x's gradient rows there the same way; so on that path
    both are masked unless the caller knows offs[-1] == M and passes zero_padding_rows=False to
    skip the two extra elementwise passes.
    """
    if not _use_cuda_grouped_mm(x):
        if torch.compiler.is_compiling():
            return grouped_mm_reference(x, w.to(x.dtype), offs)
        return grouped_mm_sliced(x, w.to(x.dtype), offs)
    w = w.to(torch.bfloat16)
    if not zero_padding_rows:
        return torch._grouped_mm(x, w, offs=offs)
    in_group = (torch.arange(x.shape[0], device=x.device) < offs[-1]).unsqueeze(-1)
    out = torch._grouped_mm(torch.where(in_group, x, 0), w, offs=offs)
    return torch.where(in_group, out, 0)
