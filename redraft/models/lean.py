"""A Llama-family target's forward without transformers' module machinery: the same kernels, in
the same order, with less Python between them (CPU float32 decoding).

On a small CPU a forward of the default target (SmolLM2-135M, 30 layers) spends about a fifth
of its time outside the kernels: ~400 module calls, their hooks and keyword plumbing, and the
per-forward swap of every linear's ``forward`` that
:func:`redraft.models.cpu.use_packed` makes. :class:`LeanForward` walks the decoder layers
itself and calls what those modules would have called: each norm's own ``forward``, each group
of sibling linears' kernel (:class:`redraft.models.siblings.Group`, one product per group),
transformers' ``apply_rotary_pos_emb``, the cache's ``update`` and the registered attention
function. The output equals transformers' forward bit for bit (``tests/models/test_lean.py``
compares them); anything this walk does not know (another architecture, a hook on a module,
linears that are not the traced groups it expects) keeps transformers' forward.

transformers' own fast paths do not remove this cost: ``torch.compile`` needs static shapes for
its CPU graphs and a C++ toolchain, and speculative trees change size every step.
"""

from __future__ import annotations

import torch

# the module classes whose forwards this walk replays (transformers' Llama code)
_CLASSES = {
    "model": "LlamaModel",
    "layer": "LlamaDecoderLayer",
    "attn": "LlamaAttention",
    "mlp": "LlamaMLP",
}


# transformers' own output recorders (installed on decoder layers and attention modules the
# first time a forward returns hidden states): inert outside such a forward, which the walk
# never is (it returns the states itself)
_RECORDERS = "transformers.utils.output_capturing"


def _has_hooks(module: torch.nn.Module) -> bool:
    """Whether a hook the walk would skip is registered on ``module``."""
    hooks = [
        *module._forward_hooks.values(),
        *module._forward_pre_hooks.values(),
    ]
    return any(getattr(h, "__module__", None) != _RECORDERS for h in hooks)


class LeanForward:
    """``base``'s forward (a transformers ``LlamaModel``) over redraft's cache, as a walk over its
    layers; build with :meth:`build` (``None`` where the walk does not apply)."""

    def __init__(self, base, layers: list[tuple]):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama import modeling_llama

        self.attention_functions = ALL_ATTENTION_FUNCTIONS
        self.base = base
        self.layers = layers  # per decoder layer: (layer, qkv group, o group, gate/up, down)
        self.eager = modeling_llama.eager_attention_forward

    @classmethod
    def build(cls, base, groups: list) -> LeanForward | None:
        """The walk for ``base`` with the sibling ``groups`` traced from it, or ``None`` (and
        transformers' forward runs) where ``base`` is not a plain Llama-family model whose
        linears are exactly the groups ``[q, k, v]``, ``[o]``, ``[gate, up]``, ``[down]`` of
        each layer."""
        if type(base).__name__ != _CLASSES["model"] or not groups:
            return None
        by_first = {g.layers[0]: g for g in groups}
        layers = []
        if len(base.layers) != base.config.num_hidden_layers:
            return None
        for layer in base.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if (
                type(layer).__name__ != _CLASSES["layer"]
                or type(attn).__name__ != _CLASSES["attn"]
                or type(mlp).__name__ != _CLASSES["mlp"]
            ):
                return None
            want = [
                [attn.q_proj, attn.k_proj, attn.v_proj],
                [attn.o_proj],
                [mlp.gate_proj, mlp.up_proj],
                [mlp.down_proj],
            ]
            found = [by_first.get(w[0]) for w in want]
            if any(g is None or g.layers != w for g, w in zip(found, want)):
                return None
            modules = [layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm]
            if any(_has_hooks(m) for m in modules + [x for w in want for x in w]):
                return None
            layers.append((layer, *found))
        glob = torch.nn.modules.module
        if _has_hooks(base) or glob._global_forward_hooks or glob._global_forward_pre_hooks:
            return None
        return cls(base, layers)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [B, heads, n, d]`` rotated: ``x * cos + [x2, x1] * sin`` (``sin`` with its first
        half negated)."""
        return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin

    def __call__(self, ids, positions, mask, cache, rows: tuple[int, int], hidden_layers=()):
        """The forward of ``ids [B, n]`` at ``positions [B, n]`` with the 4D additive ``mask``
        over ``cache``; the sibling groups run packed for ``rows[0]`` to ``rows[1]`` rows.
        Returns the final hidden states after the norm ``[B, n, H]``, or with
        ``hidden_layers`` the states ``transformers`` returns as ``hidden_states[i]`` for each
        (``0`` the embeddings, ``i`` the output of layer ``i - 1``) side by side, then the final
        ones: ``[B, n, (len + 1) H]``."""
        base = self.base
        attention = self.attention_functions.get_interface(
            base.config._attn_implementation, self.eager
        )
        lo, hi = rows
        hidden = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(hidden, position_ids=positions)  # [B, n, d]
        half = sin.shape[-1] // 2
        # transformers' rotary, q * cos + rotate_half(q) * sin with rotate_half(q) = [-q2, q1],
        # as q * cos + [q2, q1] * [-sin1, sin2]: the same products and sums, bit for bit, in
        # 4 ops instead of 7, and once for q and k together where they are one product
        cos, sin = cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), -1).unsqueeze(1)
        states = [hidden] if hidden_layers else None
        shape = (*hidden.shape[:-1], -1)
        for layer, qkv, o, gate_up, down in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            d = attn.head_dim
            x = layer.input_layernorm.forward(hidden)
            way = qkv.way(x, lo, hi)
            if way == "linear":
                q, k, v = (y.view(*shape, d).transpose(1, 2) for y in qkv.outputs(x, lo, hi))
                q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            else:
                y = qkv.product(x, way)
                (q0, q1), (_, k1) = qkv.bounds[0], qkv.bounds[1]
                qk = self.rope(y[..., q0:k1].view(*shape, d).transpose(1, 2), cos, sin)
                q, k = qk[:, : (q1 - q0) // d], qk[:, (q1 - q0) // d :]
                v0, v1 = qkv.bounds[2]
                v = y[..., v0:v1].view(*shape, d).transpose(1, 2)
            k, v = cache.update(k, v, attn.layer_idx)
            a, _ = attention(
                attn,
                q,
                k,
                v,
                mask,
                dropout=0.0,
                scaling=attn.scaling,
                position_ids=positions,
                use_cache=True,
            )
            a = a.reshape(*hidden.shape[:-1], -1).contiguous()
            hidden = hidden + o.outputs(a, lo, hi)[0]
            x = layer.post_attention_layernorm.forward(hidden)
            g, u = gate_up.outputs(x, lo, hi)
            hidden = hidden + down.outputs(mlp.act_fn(g) * u, lo, hi)[0]
            if states is not None:
                states.append(hidden)
        out = base.norm.forward(hidden)
        if not hidden_layers:
            return out
        states[-1] = out  # transformers ties its last hidden state to the normed one
        return torch.cat([states[i] for i in hidden_layers] + [out], -1)
