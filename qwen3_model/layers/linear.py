"""Tensor-parallel linear layers, split the way vLLM splits them.

Column-parallel layers (QKV, gate_up) keep a slice of the output features on each rank, so their
outputs feed the next op without communication; row-parallel layers (o_proj, down_proj) keep a slice
of the input features and all-reduce their partial sums. One all-reduce per attention block and one
per MLP.

Every parameter carries ``weight_loader(param, loaded[, shard_id])``: it receives the full tensor from
the checkpoint, checks its shape (a ValueError saying what was expected) and copies this rank's slice.
Parameters are created with ``torch.empty`` in the current default dtype and device; the loader fills
them.

FP8 (``quantization="fp8"``, Qwen3-*-FP8 checkpoints): ``weight`` is float8_e4m3fn [out_local,
in_local] and ``weight_scale_inv`` fp32 [ceil(out_local/128), ceil(in_local/128)], one scale per
128 x 128 block, sharded with its weight (the loaders slice it in blocks); the projection runs
``qwen3_kernels.linear_fp8``. A shard or fused-part boundary inside a 128 block cannot be split
that way: the layer refuses it when it is built. Its input may come quantized already
(``Fp8Activation``: the decoder's norms and silu_and_mul produce it above one token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

import qwen3_kernels
from qwen3_model.distributed import all_reduce, divide, get_tp_rank, get_tp_world_size, push_linear


def _runs_op(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the projection goes through qwen3_kernels.linear (which picks the GEMV, a CUTLASS
    configuration or cuBLAS from the shape: csrc/kernels/gemm/linear.cu): on CUDA with the kernels
    built, bf16 / fp16, N and K multiples of 8. Everything else (CPU, fp32) runs F.linear."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.shape[0] % 8 == 0
        and weight.shape[1] % 8 == 0
        and qwen3_kernels.has_cuda_kernels()
    )


FP8_BLOCK = qwen3_kernels.reference.FP8_GROUP  # rows and columns of a weight_scale_inv block
FP8_DTYPE = torch.float8_e4m3fn


class Fp8Activation(NamedTuple):
    """An activation quantized for the FP8 projections by the op that produced it
    (qwen3_kernels.rms_norm_fp8, fused_add_rms_norm_fp8, silu_and_mul_fp8): float8_e4m3fn values
    [T, K] and fp32 scales [T, ceil(K/128)] in the GEMM's layout (fp8_scales_buffer), and the
    dtype it had (the projection's output dtype). The same numbers linear_fp8 would make of the
    activation, without its own quantizing pass."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear one row at a time, each row a fresh [1, in] tensor: every row goes through the
    same GEMV call whatever the number of rows (F.linear over [T, in] does not: MKL's fp32 GEMM
    rounds a row differently at T = 1..8 than in a larger T). The deterministic mode's
    projection where the linear op does not run (CPU, fp32)."""
    if x.dim() != 2 or x.shape[0] <= 1:
        return F.linear(x.clone() if x.dim() == 2 else x, weight, bias)
    return torch.cat([F.linear(x[i : i + 1].clone(), weight, bias) for i in range(x.shape[0])])


def linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor,
           bias: torch.Tensor | None = None, weight_scale_inv: torch.Tensor | None = None,
           batch_invariant: bool = False) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T (+ bias [out]) -> [T, out]: the linear op where
    ``_runs_op``, F.linear otherwise. With ``weight_scale_inv`` [ceil(out/128), ceil(in/128)]
    the weight is FP8 and linear_fp8 runs (its reference where its kernel does not), on x
    itself or, an ``Fp8Activation``, on its quantized values. ``batch_invariant``: each row's
    result does not depend on T (the deterministic mode; not with FP8 weights, which the engine
    refuses in that mode)."""
    if isinstance(x, Fp8Activation):
        out = torch.empty(x.values.shape[0], weight.shape[0], dtype=x.dtype,
                          device=x.values.device)
        qwen3_kernels.linear_fp8(x.values, weight, weight_scale_inv, out=out, x_scales=x.scales)
        return out.add_(bias) if bias is not None else out
    if weight_scale_inv is not None:
        out = qwen3_kernels.linear_fp8(x.contiguous(), weight, weight_scale_inv)
        return out.add_(bias) if bias is not None else out
    if not _runs_op(x, weight):
        return (row_invariant_linear if batch_invariant else F.linear)(x, weight, bias)
    out = qwen3_kernels.linear(x.contiguous(), weight, batch_invariant=batch_invariant)
    return out.add_(bias) if bias is not None else out


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None,
                        weight_scale_inv: torch.Tensor | None = None,
                        batch_invariant: bool = False) -> torch.Tensor:
    """silu_and_mul(x [T, in] @ weight [2I, in]^T (+ bias [2I])) -> [T, I]; weight is gate | up.

    The linear_silu_and_mul op where ``_runs_op`` and there is no bias (one pass over the weight
    at one token, cuBLAS + silu_and_mul above), linear_fp8_silu_and_mul likewise for an FP8
    weight; ``linear`` and then silu_and_mul otherwise (and with ``batch_invariant``: the fused
    one-token pass rounds differently from the GEMM the other token counts run).
    """
    if batch_invariant:
        return qwen3_kernels.silu_and_mul(linear(x, weight, bias, weight_scale_inv, True))
    if weight_scale_inv is not None:
        if bias is None and weight.shape[0] % 16 == 0:
            return qwen3_kernels.linear_fp8_silu_and_mul(x.contiguous(), weight, weight_scale_inv)
        return qwen3_kernels.silu_and_mul(linear(x, weight, bias, weight_scale_inv))
    if bias is None and _runs_op(x, weight):
        return qwen3_kernels.linear_silu_and_mul(x.contiguous(), weight)
    return qwen3_kernels.silu_and_mul(linear(x, weight, bias))


def check_loaded_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"expected shape {tuple(expected)}, got {tuple(loaded.shape)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Replicated parameters (norm weights): the whole tensor on every rank."""
    check_loaded_shape(loaded, param.shape)
    param.data.copy_(loaded)


def fp8_blocks(n: int) -> int:
    """The 128-blocks covering n rows or columns of an FP8 weight (the last may be partial)."""
    return -(-n // FP8_BLOCK)


class LinearBase(nn.Module):
    """weight [out_local, in_local] (+ bias [out_local]); ``tp_dim`` is the dim split across ranks
    (0: output features, 1: input features, None: replicated). With ``quantization="fp8"``:
    weight float8_e4m3fn and weight_scale_inv fp32 [ceil(out_local/128), ceil(in_local/128)].
    ``name`` (e.g. "qkv_proj") is for error messages. ``batch_invariant`` (set on the whole
    model by Qwen3ForCausalLM): the deterministic mode's projection (``linear``)."""

    batch_invariant = False

    def __init__(self, in_local: int, out_local: int, bias: bool, tp_dim: int | None,
                 quantization: str | None = None, name: str = "linear"):
        super().__init__()
        if quantization not in (None, "fp8"):
            raise ValueError(f"{name}: quantization must be None or 'fp8', got {quantization!r}")
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_world_size()
        self.tp_dim = tp_dim
        self.name = name
        self.in_local, self.out_local = in_local, out_local
        fp8 = quantization == "fp8"
        weight = torch.empty(out_local, in_local, dtype=FP8_DTYPE if fp8 else None)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if fp8:
            if in_local % 16 or out_local % 8:  # what linear_fp8 needs (16-byte rows)
                raise ValueError(
                    f"FP8 {name}: the weight per rank is [{out_local}, {in_local}]; linear_fp8 "
                    "needs in features a multiple of 16 and out features a multiple of 8")
            scales = torch.empty(fp8_blocks(out_local), fp8_blocks(in_local), dtype=torch.float32)
            self.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
            self.weight_scale_inv.weight_loader = self.weight_loader
        else:
            self.register_parameter("weight_scale_inv", None)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _set_shard_ids(self, shard_ids: tuple) -> None:
        self.shard_ids = shard_ids
        for p in (self.weight, self.weight_scale_inv, self.bias):
            if p is not None:
                p.shard_ids = shard_ids

    def _check_fp8_parts(self, parts: list[tuple[str, int]], dim: str) -> None:
        """FP8: each (label, size per rank) part of the weight along ``dim`` starts on a 128
        block in the rank's weight and in the checkpoint's tensor, so the scales split with it:
        every part but the last a multiple of 128, and the last too when the tensors are split
        over ranks (rank r's slice starts at r * size)."""
        if self.weight_scale_inv is None:
            return
        for i, (label, size) in enumerate(parts):
            if size % FP8_BLOCK and (i < len(parts) - 1 or self.tp_size > 1):
                where = (f" at tensor-parallel size {self.tp_size}" if self.tp_size > 1 else "")
                raise ValueError(
                    f"FP8 {self.name}: {label} is {size} {dim} per rank{where}, not a multiple of "
                    f"the {FP8_BLOCK}-wide weight_scale_inv block: the next part or rank's slice "
                    "would start inside a block (FP8 weights split on block boundaries only)")

    def _span(self, param: nn.Parameter, start: int, size: int) -> tuple[int, int]:
        """(start, size) of weight rows / columns as indices of ``param``: themselves for the
        weight, their 128-blocks for weight_scale_inv (``_check_fp8_parts`` aligned them)."""
        if param is self.weight_scale_inv:
            return start // FP8_BLOCK, fp8_blocks(size)
        return start, size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [T, in_local] -> [T, out_local]
        return linear(x, self.weight, self.bias, self.weight_scale_inv, self.batch_invariant)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quantization: str | None = None, name: str = "linear"):
        super().__init__(input_size, output_size, bias, tp_dim=None, quantization=quantization,
                         name=name)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks: rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quantization: str | None = None, name: str = "linear"):
        tp = get_tp_world_size()
        super().__init__(input_size, divide(output_size, tp, "output features"), bias, tp_dim=0,
                         quantization=quantization, name=name)
        self.output_size = output_size
        if type(self) is ColumnParallelLinear:
            self._check_fp8_parts([("the output", self.out_local)], "rows")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.out_local
        start, rows = self._span(param, self.tp_rank * n, n)
        check_loaded_shape(loaded, (self._span(param, 0, n * self.tp_size)[1], *param.shape[1:]))
        param.data.copy_(loaded.narrow(0, start, rows))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one GEMM (gate_up_proj).

    The local weight is [sum_i output_sizes[i] / tp, in]: each rank keeps its slice of every part,
    concatenated in order, so ``silu_and_mul`` finds gate | up on every rank.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quantization: str | None = None, name: str = "linear"):
        self.output_sizes = list(output_sizes)
        tp = get_tp_world_size()
        for i, size in enumerate(self.output_sizes):
            divide(size, tp, f"output features of merged part {i}")
        super().__init__(input_size, sum(self.output_sizes), bias, quantization, name)
        self._set_shard_ids(tuple(range(len(self.output_sizes))))
        self._check_fp8_parts([(f"part {i} ({size} rows in all)", size // tp)
                               for i, size in enumerate(self.output_sizes)], "rows")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(f"shard id must be one of {self.shard_ids}, got {shard_id!r}")
        full = self.output_sizes[shard_id]
        check_loaded_shape(loaded, (self._span(param, 0, full)[1], *param.shape[1:]))
        n = full // self.tp_size
        offset, rows = self._span(param, sum(self.output_sizes[:shard_id]) // self.tp_size, n)
        start, _ = self._span(param, self.tp_rank * n, n)
        param.data.narrow(0, offset, rows).copy_(loaded.narrow(0, start, rows))


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q | k | v projection: local weight [(Hq_local + 2 * Hkv_local) * D, hidden].

    Query heads split evenly across ranks. With fewer kv heads than ranks, each kv head is replicated
    on tp / Hkv ranks (rank r holds kv head r // (tp / Hkv)), as vLLM does; otherwise kv heads split
    evenly too.
    """

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False, quantization: str | None = None,
                 name: str = "qkv_proj"):
        tp = get_tp_world_size()
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp, "num_attention_heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = divide(total_num_kv_heads, tp, "num_key_value_heads")
            self.num_kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.num_kv_replicas = divide(tp, total_num_kv_heads, "tensor-parallel size over num_key_value_heads")
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, output_size, bias, quantization, name)
        self._set_shard_ids(("q", "k", "v"))
        d = head_dim
        self._check_fp8_parts([
            (f"q ({self.num_heads} heads x head_dim {d})", self.num_heads * d),
            (f"k ({self.num_kv_heads} kv heads x head_dim {d})", self.num_kv_heads * d),
            (f"v ({self.num_kv_heads} kv heads x head_dim {d})", self.num_kv_heads * d),
        ], "rows")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        q_local, kv_local = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            full, n, offset, head0 = self.total_num_heads * d, q_local, 0, self.tp_rank * self.num_heads
        elif shard_id in ("k", "v"):
            full, n = self.total_num_kv_heads * d, kv_local
            offset = q_local if shard_id == "k" else q_local + kv_local
            head0 = (self.tp_rank // self.num_kv_replicas) * self.num_kv_heads
        else:
            raise ValueError(f"shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        check_loaded_shape(loaded, (self._span(param, 0, full)[1], *param.shape[1:]))
        offset, rows = self._span(param, offset, n)
        start, _ = self._span(param, head0 * d, n)
        param.data.narrow(0, offset, rows).copy_(loaded.narrow(0, start, rows))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed by an all-reduce.

    x [T, in/tp] -> [T, out], identical on every rank. The bias is added once, after the reduce.
    With ``reduce_results=False`` the output is this rank's partial sum, left for the caller to
    reduce (the decoder fuses the all-reduce into the residual add + RMSNorm that follows); the
    bias is then added on rank 0 only, before that reduce, so it still counts once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True, quantization: str | None = None,
                 name: str = "linear"):
        tp = get_tp_world_size()
        super().__init__(divide(input_size, tp, "input features"), output_size, bias, tp_dim=1,
                         quantization=quantization, name=name)
        self.input_size = input_size
        self.reduce_results = reduce_results
        self._check_fp8_parts([(f"the input ({input_size} columns in all)", self.in_local)],
                              "columns")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias: replicated
            default_weight_loader(param, loaded)
            return
        n = self.in_local
        start, cols = self._span(param, self.tp_rank * n, n)
        check_loaded_shape(loaded, (param.shape[0], self._span(param, 0, n * self.tp_size)[1]))
        param.data.copy_(loaded.narrow(1, start, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (not self.reduce_results and self.bias is None and self.weight_scale_inv is None
                and not self.batch_invariant and _runs_op(x, self.weight)):
            # one token, our all-reduce on: the GEMV sends its row to the peers itself
            y = push_linear(x, self.weight) if x.shape[0] == 1 else None
            if y is not None:
                return y
        y = linear(x, self.weight, None, self.weight_scale_inv, self.batch_invariant)
        if not self.reduce_results:
            return y + self.bias if self.bias is not None and self.tp_rank == 0 else y
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y
