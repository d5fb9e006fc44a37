"""Training only the top layers of a decoder, with the frozen bottom's output computed once.

With `model.train_layers: K` the embeddings (tied to the output layer in the small models) and
every decoder layer below the top `K` are frozen: the update trains the top `K` layers and the
final norm. The hidden states entering layer `L - K` then depend on a row's tokens alone, never
on the training, so `FrozenBottom` computes them once per stored group and keeps them: the
behaviour pass of a fresh group computes them, the update and every later replay scan of the
group run only the top `K` layers on them. On SmolLM2-135M with `K = 4` that is 4/30 of the
backbone for a scan and for the update's forward (docs/trainer.md measures it).

Exact: a group's states are computed on its own rows as stored (`[G, T_g]`, left padded), one
group per forward, so they are the same numbers whenever they are computed (after a resume
too, when the cache starts empty). They are kept in `cache_dtype` (bfloat16 halves the memory;
the top layers take them in the compute dtype), under a byte bound, least recently used first
out, between calls: an evicted group is computed again, from its own rows, to the same values.

`backbone(model, input_ids, attention_mask)` is what teacher-forced scoring and the update call
instead of the model's own backbone: with a `FrozenBottom` attached to the model
(`attach`), rows whose states are kept run the top layers only; without one, the whole
backbone runs as before. The split reuses the backbone's own forward (its masks, positions and
rotary tables) over a sub-list of its layers, so it holds for the Llama and Qwen2 layouts
(`model.model.layers`, `model.model.norm`) across transformers releases.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_layers(model) -> nn.ModuleList:
    """The decoder's layers of a causal LM (`model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.layers to split")
    return layers


def freeze_below(model, trained: int) -> list[str]:
    """Freeze every parameter but those of the top `trained` decoder layers and the final
    norm; returns the names left trainable. Tied embeddings stay frozen with the embedding."""
    layers = decoder_layers(model)
    if not 1 <= trained <= len(layers):
        raise ValueError(f"train_layers={trained}: the model has {len(layers)} layers")
    first = len(layers) - trained
    keep = {f"model.layers.{i}." for i in range(first, len(layers))}
    trainable = []
    for name, param in model.named_parameters():
        on = name.startswith("model.norm.") or any(name.startswith(k) for k in keep)
        param.requires_grad_(on)
        if on:
            trainable.append(name)
    return trainable


@contextlib.contextmanager
def only_layers(model, layers: Sequence[nn.Module], final_norm: bool) -> Iterator[nn.Module]:
    """The backbone (`model.model`) running `layers` alone, with or without its final norm,
    for the block; its own layers and norm come back after."""
    base = model.model
    saved_layers, saved_norm = base.layers, base.norm
    base.layers = nn.ModuleList(layers)
    if not final_norm:
        base.norm = nn.Identity()
    try:
        yield base
    finally:
        base.layers, base.norm = saved_layers, saved_norm


def position_ids_for(attention_mask: Tensor) -> Tensor:
    """`cumsum(attention_mask) - 1`, clamped at 0 on the padding (as generation counts)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


class FrozenBottom:
    """The states entering the top `trained` layers, per group, kept under `max_bytes`."""

    def __init__(self, model, trained: int, cache_dtype: torch.dtype, max_bytes: int) -> None:
        layers = decoder_layers(model)
        self.split = len(layers) - trained
        self.cache_dtype = cache_dtype
        self.max_bytes = max_bytes
        self._states: OrderedDict[bytes, Tensor] = OrderedDict()  # row key -> (L_real, H)
        self._bytes = 0
        self.computed_tokens = 0  # bottom-layer tokens forwarded so far (the cost ledger's)

    @staticmethod
    def key(ids: Tensor, mask: Tensor) -> bytes:
        """A row's identity: its real tokens (padding left out)."""
        return ids[mask.bool()].to(torch.int64).numpy().tobytes()

    def fill(self, model, groups: Sequence) -> None:
        """Compute and keep the states of every group's rows not kept yet, one group (its
        stored `[G, T]` rows) per forward."""
        for group in groups:
            ids, mask = group.input_ids, group.attention_mask
            keys = [self.key(i, m) for i, m in zip(ids, mask, strict=True)]
            if all(k in self._states for k in keys):
                for k in keys:
                    self._states.move_to_end(k)
                continue
            states = self.bottom(model, ids, mask)  # (G, T, H)
            self.computed_tokens += int(mask.sum())
            for k, row, m in zip(keys, states, mask, strict=True):
                self._put(k, row[m.bool()].to(self.cache_dtype).contiguous())

    def warm(self, model, groups: Sequence) -> int:
        """`fill` for `groups`, the newest (last) first, while the kept states stay within the
        byte bound (a resumed run's buffer: its scans then run the top layers only, as they
        did before the stop). Returns the groups filled."""
        filled = 0
        for group in reversed(groups):
            if self._bytes >= self.max_bytes:
                break
            self.fill(model, [group])
            filled += 1
        return filled

    def bottom(self, model, ids: Tensor, mask: Tensor) -> Tensor:
        """The bottom layers' output for these rows, no grad: `[n, T, H]`."""
        device = next(model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad(), only_layers(model, decoder_layers(model)[: self.split], False):
            return model.model(
                input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask),
                use_cache=False,
            ).last_hidden_state  # fmt: skip

    def _put(self, key: bytes, states: Tensor) -> None:
        if key not in self._states:
            self._states[key] = states
            self._bytes += states.numel() * states.element_size()

    def _trim(self) -> None:
        """Least recently used rows out until the bound holds (after a call has taken the
        rows it filled, so none is computed again another way within it)."""
        while self._bytes > self.max_bytes and self._states:
            _, old = self._states.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def states(self, model, ids: Tensor, mask: Tensor) -> Tensor:
        """`[n, T, H]` states of these rows, left padded with zeros, in float32 (autocast
        casts as the top layers run). Rows not kept (not of a filled group: an SFT batch)
        are computed together, in one forward, and kept."""
        ids, mask = ids.cpu(), mask.cpu()
        keys = [self.key(i, m) for i, m in zip(ids, mask, strict=True)]
        missing = [k for k, key in enumerate(keys) if key not in self._states]
        if missing:
            computed = self.bottom(model, ids[missing], mask[missing])
            self.computed_tokens += int(mask[missing].sum())
            for k, row in zip(missing, computed, strict=True):
                self._put(keys[k], row[mask[k].bool()].to(self.cache_dtype).contiguous())
        out = torch.zeros(*ids.shape, self.width(model), dtype=torch.float32)
        for i, key in enumerate(keys):
            self._states.move_to_end(key)
            out[i, mask[i].bool()] = self._states[key].float()
        self._trim()
        return out.to(next(model.parameters()).device)

    @staticmethod
    def width(model) -> int:
        return model.config.hidden_size

    def top(self, model, states: Tensor, mask: Tensor) -> Tensor:
        """The top layers and the final norm over `states`: the backbone's last hidden
        state `[n, T, H]` (grad as the caller's mode)."""
        with only_layers(model, decoder_layers(model)[self.split :], True) as base:
            return base(
                inputs_embeds=states, attention_mask=mask, position_ids=position_ids_for(mask),
                use_cache=False,
            ).last_hidden_state  # fmt: skip


def cast_frozen_once(model) -> int:
    """Give each frozen linear layer on the CPU (the bottom's, and the output layer tied to the
    frozen embeddings) its weight in the autocast dtype, cast on first use and kept while the
    weight is unchanged. Autocast keeps the casts of trained weights within a forward and casts
    frozen ones again at every call: on SmolLM2 the output layer's cast was a tenth of a replay
    scan. Exact: the same cast, made once. On a GPU the cast is a few milliseconds and the
    copy would cost memory, so layers there are left as they are. Returns the layers changed."""
    changed = 0
    for module in model.modules():
        if (
            type(module) is nn.Linear  # a subclass (a quantized layer) has its own forward
            and module.weight.device.type == "cpu"
            and not any(p.requires_grad for p in module.parameters())
        ):
            module.forward = types.MethodType(_linear_cast_once, module)
            changed += 1
    return changed


def _linear_cast_once(self: nn.Linear, x: Tensor) -> Tensor:
    """`nn.Linear.forward` with the weight's autocast copy kept (`cast_frozen_once`); the copy
    is made again when the weight is replaced or changed in place (its storage or version)."""
    device = x.device.type
    weight = self.weight
    if device != "cpu" or not torch.is_autocast_enabled(device) or hasattr(weight, "ds_id"):
        return nn.Linear.forward(self, x)  # (a ZeRO-3 parameter, `ds_id`, is gathered per call)
    dtype = torch.get_autocast_dtype(device)
    state = (weight.data_ptr(), weight._version, dtype)
    kept = self.__dict__.get("_cast_once")  # (the parameter, its state, weight, bias) cast
    if kept is None or kept[0] is not weight or kept[1] != state:
        bias = None if self.bias is None else self.bias.detach().to(dtype)
        kept = self.__dict__["_cast_once"] = (weight, state, weight.detach().to(dtype), bias)
    return F.linear(x, kept[2], kept[3])  # autocast casts `x`; the weight is already `dtype`


def attach(model, trained: int, cache_dtype: torch.dtype, max_bytes: int) -> FrozenBottom:
    """Freeze `model` below its top `trained` layers, keep its frozen linear layers' autocast
    casts (`cast_frozen_once`) and attach the states' cache that `backbone` uses for it."""
    freeze_below(model, trained)
    cast_frozen_once(model)
    bottom = FrozenBottom(model, trained, cache_dtype, max_bytes)
    _ATTACHED[model] = bottom
    return bottom


def attached(model) -> FrozenBottom | None:
    """The `FrozenBottom` attached to `model`, if any."""
    return _ATTACHED.get(model)


def backbone(model, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The backbone's last hidden state `[n, T, H]` for left-padded rows: through the kept
    bottom states and the top layers when a `FrozenBottom` is attached, else the whole
    backbone."""
    bottom = attached(model)
    if bottom is None:
        return model.base_model(
            input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids_for(attention_mask), use_cache=False,
        ).last_hidden_state  # fmt: skip
    return bottom.top(model, bottom.states(model, input_ids, attention_mask), attention_mask)
