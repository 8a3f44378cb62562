"""(torch) A leaner forward pass for Llama-family models on the CPU, over the paged KV pool.

Same weights and the same arithmetic as transformers' eager forward, with far fewer operations
per layer: q/k/v and gate/up are each one matmul (the module weights become views into the
concatenated tensors), weights are also kept in the layouts of the matmul kernels (32-column panels
for float32 decode steps and oneDNN's prepacked form for larger float32 steps; in bf16, AMX tiles
where the CPU has them and oneDNN's prepacked form: extra copies of the weights, the price of
reading them at memory speed), and the element-wise work between matmuls runs in the C++ kernels
of `fused_ops.cpp`: residual add + RMSNorm, rotary + KV store, SiLU(gate) * up. Per layer that is 9 calls instead of ~40.

`FusedLlama.build(model)` returns None for anything it does not cover (other architectures,
biases in norms, sliding windows, non-SiLU MLPs, devices other than the CPU, missing kernels); the
runner then uses the transformers forward with the "conveyor_paged" attention instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.core.attention import PagedBatch, gathered_attention

# Architectures whose decoder layer is exactly: RMSNorm -> q/k/v (optional bias) -> rotary ->
# causal attention -> o_proj -> +residual -> RMSNorm -> SiLU-gated MLP -> +residual.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


SMALL_M = 128  # float32 linears with at most this many rows use conveyor's panel kernel (BLAS above)
SMALL_M_BF16 = 8  # bfloat16 without AMX: the panel kernel up to this many rows, oneDNN above
AMX_MAX_M = 1024  # bfloat16 with AMX: conveyor's tile kernel up to this many rows, oneDNN above
EXACT_M_ONEDNN = 64  # oneDNN calls with more rows than this are padded to a row bucket (below)


def row_bucket(m: int) -> int:
    """Rows a oneDNN call is padded to: oneDNN builds (JIT-compiles) a kernel per distinct shape,
    ~2-3 ms each on first use, and a step's row count is almost always new, so calls above
    EXACT_M_ONEDNN rows are rounded up to a multiple of 16 (32 above 512 rows, 64 above 1024):
    ~60 shapes per weight up to 2048 rows, each built once, for half a step of zero rows per call
    on average (under 6% of the work above 128 rows, ~3% above 512)."""
    if m <= EXACT_M_ONEDNN:
        return m
    step = 16 if m <= 512 else 32 if m <= 1024 else 64
    return -(-m // step) * step


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N / 32), K, 32]: 32-column panels of W.T, each contiguous (zero-padded)."""
    n, k = weight.shape
    panels = -(-n // 32)
    wt = torch.zeros(k, panels * 32, dtype=weight.dtype)
    wt[:, :n] = weight.t()
    return wt.view(k, panels, 32).permute(1, 0, 2).contiguous()


def pack_amx(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K a multiple of 32) -> [ceil(N / 32), K / 32, 2, 16, 16, 2]: for each panel of 32 output
    columns, for each 32-wide slice of K, two 16 x 16 tiles of (k, k + 1) pairs: the layout of the B
    operand of AMX's TDPBF16PS, one contiguous run per panel (zero-padded columns)."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"pack_amx: K={k} is not a multiple of 32")
    padded = -(-n // 32) * 32
    w = weight if padded == n else torch.cat([weight, weight.new_zeros(padded - n, k)])
    return w.reshape(padded // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


class _Linear:
    """y = x @ W.T (+ b), by the fastest exact-enough route measured for the rows at hand.

    float32: up to SMALL_M rows (decode steps) go to the C++ kernel over 32-column panels of W,
    which streams the weights under its arithmetic (measured 1.1-1.9x faster than BLAS at 1-128
    rows on the model's shapes); more rows (prompt steps) to oneDNN with W prepacked once, rows
    padded to a bucket (on an AMD EPYC 182-199 GFLOP/s at 64-256 rows where torch's MKL GEMM ran
    107-142; as fast or a little faster than MKL on the Xeon), torch's GEMM where oneDNN is missing.
    bfloat16 on CPUs with AMX: conveyor's tile kernel (`amx_gemm.cpp`) up to AMX_MAX_M rows (1.1-2x
    oneDNN's rate there, a read of the weights at small M; in the engine 1.2-2.2x per call at
    416-512 rows, whole such steps 4-13% faster); above, oneDNN with the weights prepacked once (as
    fast or faster there: 1.4x at 2048 rows on the model's layers alone, 1.0-1.5x per layer shape in
    the engine), rows padded to a bucket (`row_bucket`). Without AMX: the panel kernel up to
    SMALL_M_BF16 rows (a weight read: 10-25% faster than oneDNN's per-call overhead on small
    layers), oneDNN above.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, ops) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed = None
        self.panels = None
        self.small_gemm = None
        self.amx = None
        self.amx_gemm = None
        if (weight.dtype == torch.bfloat16 and weight.shape[1] % 32 == 0 and ops is not None
                and hasattr(ops, "amx_gemm") and ops.amx_gemm_available()):
            self.amx = pack_amx(weight)
            self.amx_gemm = ops.amx_gemm
        elif weight.dtype in (torch.float32, torch.bfloat16) and ops is not None and hasattr(ops, "small_gemm"):
            self.panels = pack_panels(weight)
            self.small_gemm = ops.small_gemm
        if (weight.dtype == torch.bfloat16 and _onednn_bf16()) or (weight.dtype == torch.float32 and _onednn()):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
                probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
                got = torch.ops.mkldnn._linear_pointwise(probe, packed, bias, "none", [], "")
                want = F.linear(probe, weight, bias)
                if torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                    self.packed = packed
            except (RuntimeError, AttributeError):
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None and (x.shape[0] <= AMX_MAX_M or self.packed is None):
            return self.amx_gemm(x, self.amx, self.out_features, self.bias)
        limit = SMALL_M if self.weight.dtype == torch.float32 else SMALL_M_BF16
        if self.panels is not None and x.shape[0] <= limit:
            return self.small_gemm(x, self.panels, self.out_features, self.bias)
        if self.packed is not None:
            m = x.shape[0]
            padded = row_bucket(m)
            if padded != m:  # zero rows below x; their outputs are dropped
                x = torch.cat([x, x.new_zeros(padded - m, x.shape[1])])
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y if padded == m else y[:m]
        return F.linear(x, self.weight, self.bias)


def _onednn() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available())
    except (RuntimeError, AttributeError):
        return False


def _onednn_bf16() -> bool:
    try:
        return _onednn() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


def _concat_as_views(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [sum(N), K] weight (and bias); each module's parameters become views into it."""
    weight = torch.cat([m.weight.detach() for m in modules])
    offset = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[offset:offset + n]
        offset += n
    if all(m.bias is None for m in modules):
        return weight, None
    bias = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.weight.shape[0], dtype=weight.dtype)
                      for m in modules])
    offset = 0
    for m in modules:
        n = m.weight.shape[0]
        if m.bias is not None:
            m.bias.data = bias[offset:offset + n]
        offset += n
    return weight, bias


class _Layer:
    def __init__(self, layer: torch.nn.Module, ops) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _Linear(*_concat_as_views([attn.q_proj, attn.k_proj, attn.v_proj]), ops)
        self.o = _Linear(attn.o_proj.weight.detach(), _bias(attn.o_proj), ops)
        self.gate_up = _Linear(*_concat_as_views([mlp.gate_proj, mlp.up_proj]), ops)
        self.down = _Linear(mlp.down_proj.weight.detach(), _bias(mlp.down_proj), ops)
        self.norm_in = layer.input_layernorm.weight.detach()
        self.norm_post = layer.post_attention_layernorm.weight.detach()
        self.eps_in = float(layer.input_layernorm.variance_epsilon)
        self.eps_post = float(layer.post_attention_layernorm.variance_epsilon)


def _bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


class FusedLlama:
    """Callable: (input_ids [T], positions [T], batch, sample_rows [S]) -> logits [S, vocab]."""

    def __init__(self, model: torch.nn.Module, ops) -> None:
        cfg = model.config
        inner = model.model
        self.ops = ops
        self.embed = inner.embed_tokens.weight.detach()
        self.rotary = inner.rotary_emb
        self.layers = [_Layer(layer, ops) for layer in inner.layers]
        self.norm = inner.norm.weight.detach()
        self.norm_eps = float(inner.norm.variance_epsilon)
        self.lm_head = _Linear(model.lm_head.weight.detach(), _bias(model.lm_head), ops)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = inner.layers[0].self_attn.scaling
        self.logit_scale = getattr(cfg, "logits_scaling", None)

    @classmethod
    def build(cls, model: torch.nn.Module, ops) -> FusedLlama | None:
        """A FusedLlama over `model`'s weights, or None where this forward does not apply."""
        if ops is None or not hasattr(ops, "rms_norm"):
            return None
        cfg = model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return None
        if next(model.parameters()).device.type != "cpu":
            return None
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return None
        if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
            return None
        inner = getattr(model, "model", None)
        try:
            layers = list(inner.layers)
            expected = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
            for layer in layers:
                if {name for name, _ in layer.named_children()} != expected:
                    return None  # extra norms (q_norm, k_norm, ...): not this architecture
                if {name for name, _ in layer.self_attn.named_children()} != {"q_proj", "k_proj", "v_proj", "o_proj"}:
                    return None
                if {name for name, _ in layer.mlp.named_children()} != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
                    return None
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    if {name for name, _ in norm.named_parameters()} != {"weight"}:
                        return None
            if not hasattr(inner, "rotary_emb") or not hasattr(inner.norm, "variance_epsilon"):
                return None
        except AttributeError:
            return None
        if getattr(cfg, "logits_scaling", None) is not None or getattr(cfg, "final_logit_softcapping", None):
            return None
        return cls(model, ops)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
                 sample_rows: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        H = self.num_heads
        h = F.embedding(input_ids, self.embed)  # [T, hidden]; the residual stream, updated in place
        cos, sin = self.rotary(h, positions.unsqueeze(0))
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        delta = None
        for i, layer in enumerate(self.layers):
            x = ops.rms_norm(h, delta, layer.norm_in, layer.eps_in)  # h += delta (the last MLP's output)
            qkv = layer.qkv(x)
            ops.rope_store(qkv, cos, sin, batch.slot_mapping, batch.keys[i], batch.values[i], H)
            attn = self._attention(qkv, batch, i)
            x = ops.rms_norm(h, layer.o(attn), layer.norm_post, layer.eps_post)  # h += attention output
            delta = layer.down(ops.silu_mul(layer.gate_up(x)))
        rows = h.index_select(0, sample_rows)
        x = ops.rms_norm(rows, delta.index_select(0, sample_rows), self.norm, self.norm_eps)
        return self.lm_head(x)

    def _attention(self, qkv: torch.Tensor, batch: PagedBatch, layer: int) -> torch.Tensor:
        """qkv [T, (H + 2 Hkv) D] (rotated) -> attention output [T, H D]."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        T = qkv.shape[0]
        q = qkv[:, :H * D].view(T, H, D)
        k_cache, v_cache = batch.keys[layer], batch.values[layer]
        if batch.kernel is not None and batch.has_paged_rows and batch.paged_rows is None:  # all rows: one call
            return self._paged(q, k_cache, v_cache, batch).view(T, H * D)
        out = torch.empty(T, H, D, dtype=qkv.dtype)
        if batch.kernel is not None and batch.has_paged_rows:
            out[batch.paged_rows] = self._paged(q[batch.paged_rows], k_cache, v_cache, batch)
        for g in batch.gathered:  # without the kernel: K/V gathered for SDPA
            out[g.rows] = gathered_attention(q[g.rows], k_cache, v_cache, g, batch.block_size, self.scale)
        for start, end in batch.fresh_chunks:
            chunk = qkv[start:end]
            n = end - start
            qc = chunk[:, :H * D].view(n, H, D).transpose(0, 1)
            kc = chunk[:, H * D:(H + Hkv) * D].view(n, Hkv, D).transpose(0, 1)
            vc = chunk[:, (H + Hkv) * D:].view(n, Hkv, D).transpose(0, 1)
            o = F.scaled_dot_product_attention(qc.unsqueeze(0), kc.unsqueeze(0), vc.unsqueeze(0), is_causal=True,
                                               scale=self.scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out.view(T, H * D)

    def _paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        return batch.kernel(q, k_cache, v_cache, batch.tables, batch.token_req, batch.token_ctx,
                            batch.block_size, self.scale)
