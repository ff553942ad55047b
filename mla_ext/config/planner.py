"""KV-cache pool planning for a whole model under a byte budget (SPEC §4).

Every layer gets the same number of blocks (block ids are shared across
layers: one block table serves them all), but each layer's page has its own
size, taken from its resolved `LayerCacheSpec`. So fp8_ds_mla layers (656
B/token) sit beside skipped bf16 layers (1152 B/token) without any common page
size, which upstream engines refuse (656 and 1152 do not divide).

The plan also fixes where each layer lives inside one shared byte buffer
(`LayerPlan.offset`), so `bytes_used` is exactly what `allocate(shared=True)`
takes and the plan never over-commits the budget either way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch

from mla_ext.config.index_formats import IndexCacheSpec
from mla_ext.config.models import _ranges
from mla_ext.config.policy import SLIDING_WINDOW, LayerCacheSpec, check_bool, check_configs, resolve_model

# Each layer's region in the shared buffer starts on this boundary, as a
# separate CUDA allocation would, so kernels keep their aligned vector loads.
REGION_ALIGN = 256
# Block ids are int32 (the block table's dtype, SPEC §6): ids 0 .. 2**31 - 2, so
# at most 2**31 - 1 blocks. A budget that would buy more is clamped to this many
# blocks (the plan says so: PoolPlan.block_id_limited, and the table and JSON
# show it); it never over-commits, it leaves the rest of the budget unused.
MAX_NUM_BLOCKS = 2**31 - 1
# Byte counts are int64 everywhere in torch; no budget is larger.
MAX_MEMORY_BYTES = 2**63 - 1


@dataclass(frozen=True)
class LayerPlan:
    layer_index: int
    format_name: str
    quant_mode: str
    skip_reason: str | None
    bytes_per_token: int
    page_bytes: int  # block stride in bytes (>= block_size * bytes_per_token)
    shape: tuple[int, int, int]  # [num_blocks, block_size, entry]
    dtype: torch.dtype
    bytes: int  # num_blocks * page_bytes (0 for a layer that reads another's cache)
    offset: int  # byte offset of this layer's region in the shared buffer
    kv_source: int | None = None  # KV sharing: the layer whose cache this one reads

    @property
    def strides(self) -> tuple[int, int, int]:
        """Element strides of the cache tensor; the block stride covers any page padding."""
        return (self.page_bytes // self.dtype.itemsize, self.shape[2], 1)

    def row(self) -> tuple:
        """The fields that make two consecutive layers print as one table row."""
        return (self.format_name, self.skip_label, self.quant_mode, self.bytes_per_token,
                self.page_bytes, self.shape, self.dtype, self.bytes)

    @property
    def skip_label(self) -> str:
        """Why the layer is native, without its index ("" when not skipped)."""
        if self.skip_reason is None:
            return ""
        return "sliding window" if self.skip_reason == SLIDING_WINDOW else "skip list"


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    block_size: int
    layers: tuple[LayerPlan, ...]
    bytes_used: int
    budget: int
    alignment: int | None
    # True when the budget would buy more than MAX_NUM_BLOCKS blocks and the
    # plan was clamped to the int32 block ids.
    block_id_limited: bool = False
    # DSA layers' index-key caches (mla_ext/sparse/index_cache.py), same blocks, after the latent
    # regions in the shared buffer (empty for dense models).
    index_layers: tuple[LayerPlan, ...] = ()
    # The model's layer count when some layers have no MLA cache (plan_model of a
    # model with linear-attention layers): allocate() then returns one entry per
    # layer, None for those. None: one entry per planned layer.
    num_model_layers: int | None = None

    @property
    def tokens_capacity(self) -> int:
        """Tokens every layer can hold at once."""
        return self.num_blocks * self.block_size

    def _regions(self, plans, device, shared) -> list[torch.Tensor | None]:
        """One tensor per plan that owns bytes (None for a KV-sharing layer)."""
        if check_bool(shared, "shared"):
            buf = torch.empty(self.bytes_used, dtype=torch.uint8, device=device)

            def make(p):
                return buf[p.offset: p.offset + p.bytes].view(p.dtype).as_strided(p.shape, p.strides)
        else:
            def make(p):
                return torch.empty(p.bytes // p.dtype.itemsize, dtype=p.dtype, device=device).as_strided(
                    p.shape, p.strides)
        return [make(p) if p.kv_source is None else None for p in plans]

    def _per_layer(self, views) -> list[torch.Tensor | None]:
        """The latent regions as `allocate` returns them: a KV-sharing layer gets its
        source's tensor itself (it stores nothing); with `num_model_layers`, one entry
        per model layer (None for a layer without an MLA cache)."""
        own = {p.layer_index: v for p, v in zip(self.layers, views) if p.kv_source is None}
        per_plan = {p.layer_index: own[p.layer_index if p.kv_source is None else p.kv_source]
                    for p in self.layers}
        if self.num_model_layers is None:
            return list(per_plan.values())
        return [per_plan.get(i) for i in range(self.num_model_layers)]

    def allocate(self, device="cpu", shared: bool = False) -> list[torch.Tensor]:
        """Per-layer cache tensors `[num_blocks, B, entry]` in each layer's storage dtype.

        shared=True carves them out of one uint8 buffer of `bytes_used` bytes (views:
        they share its storage); otherwise each layer is its own allocation. Contents
        are uninitialised.
        """
        return self._per_layer(self._regions(self.layers, device, shared))

    def allocate_all(self, device="cpu", shared: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(latent caches, index caches): `allocate`, and the DSA index caches the same way."""
        views = self._regions(self.layers + self.index_layers, device, shared)
        return self._per_layer(views[:len(self.layers)]), views[len(self.layers):]

    def to_dict(self) -> dict:
        out = self._to_dict()
        if self.index_layers:
            out["index_layers"] = [{"layer": p.layer_index, "format": p.format_name, "bytes_per_token":
                                    p.bytes_per_token, "page_bytes": p.page_bytes, "shape": list(p.shape),
                                    "dtype": _dtype_name(p.dtype), "bytes": p.bytes, "offset": p.offset}
                                   for p in self.index_layers]
        return out

    def _to_dict(self) -> dict:
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "tokens_capacity": self.tokens_capacity,
            "bytes_used": self.bytes_used,
            "budget": self.budget,
            "alignment": self.alignment,
            "block_id_limited": self.block_id_limited,
            "num_model_layers": self.num_model_layers,
            "max_num_blocks": MAX_NUM_BLOCKS,
            "layers": [
                {
                    "layer": p.layer_index,
                    "format": p.format_name,
                    "quant_mode": p.quant_mode,
                    "skip_reason": p.skip_reason,
                    "bytes_per_token": p.bytes_per_token,
                    "page_bytes": p.page_bytes,
                    "shape": list(p.shape),
                    "strides": list(p.strides),
                    "dtype": _dtype_name(p.dtype),
                    "bytes": p.bytes,
                    "offset": p.offset,
                    "kv_source": p.kv_source,
                }
                for p in self.layers
            ],
        }

    def format_table(self, title: str | None = None) -> str:
        """A per-layer table; consecutive layers that differ only in index share a row."""
        head = ("layers", "format", "quant", "B/token", "page B", "cache shape", "dtype",
                "bytes/layer")
        rows = []
        for first, last, p in _group(self.layers):
            span = str(first) if first == last else f"{first}-{last}"
            fmt = p.format_name + (f" ({p.skip_label})" if p.skip_label else "")
            rows.append((span, fmt, p.quant_mode, f"{p.bytes_per_token:,}", f"{p.page_bytes:,}",
                         "[" + ", ".join(str(d) for d in p.shape) + "]",
                         _dtype_name(p.dtype), format_bytes(p.bytes)))
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
        line = "  ".join("{:<%d}" % w for w in widths)
        out = [title] if title else []
        out.append(line.format(*head).rstrip())
        out.append("  ".join("-" * w for w in widths))
        out += [line.format(*r).rstrip() for r in rows]
        pct = 100.0 * self.bytes_used / self.budget
        out += [
            "",
            f"blocks:          {self.num_blocks:,} of {self.block_size} tokens (shared by "
            f"{len(self.layers)} layers)",
            f"token capacity:  {self.tokens_capacity:,}",
            f"bytes used:      {self.bytes_used:,} ({format_bytes(self.bytes_used)}) of "
            f"{self.budget:,} ({format_bytes(self.budget)}), {pct:.2f}%",
        ]
        if self.num_model_layers is not None:
            planned = {p.layer_index for p in self.layers}
            others = [i for i in range(self.num_model_layers) if i not in planned]
            out.append(f"not MLA:         layers {_ranges(others)} (linear attention: "
                       "no MLA cache; allocate() gives None)")
        if self.block_id_limited:
            out.append(f"note:            capped at {MAX_NUM_BLOCKS:,} blocks (int32 block ids); "
                       "the rest of the budget is not used")
        for first, last, p in _group(self.index_layers):
            span = str(first) if first == last else f"{first}-{last}"
            out.append(f"index cache:     layers {span}: {p.format_name}, {p.bytes_per_token:,} B/token, page "
                       f"{p.page_bytes:,} B, [{', '.join(str(d) for d in p.shape)}] {_dtype_name(p.dtype)}, "
                       f"{format_bytes(p.bytes)}/layer")
        return "\n".join(out)


def _group(layers):
    """(first index, last index, plan) for each run of consecutive identical layers."""
    runs = []
    for p in layers:
        if runs and runs[-1][1] + 1 == p.layer_index and runs[-1][2].row() == p.row():
            runs[-1][1] = p.layer_index
        else:
            runs.append([p.layer_index, p.layer_index, p])
    return [tuple(r) for r in runs]


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _layout(specs, pages, num_blocks):
    """(offsets, region bytes, total bytes) of every layer in one shared buffer."""
    offsets, sizes, end = [], [], 0
    for page in pages:
        if page == 0:  # a KV-sharing layer: no region (its source's offset is used)
            offsets.append(end)
            sizes.append(0)
            continue
        start = _round_up(end, REGION_ALIGN)
        offsets.append(start)
        sizes.append(num_blocks * page)
        end = start + num_blocks * page
    return offsets, sizes, end


def plan_pool(
    layer_specs, memory_bytes: int, alignment: int | None = None, *, index_specs=()
) -> PoolPlan:
    """The most blocks every layer can have within `memory_bytes`.

    `alignment` rounds each layer's page up (the block stride grows; the cache
    tensor's shape does not). Raises ValueError when not even one block fits.
    `index_specs`: the DSA layers' index caches (mla_ext.sparse.index_cache.IndexCacheSpec),
    planned beside the latent pages (same block count and size; `PoolPlan.index_layers`).
    """
    if isinstance(layer_specs, (str, bytes)) or not hasattr(layer_specs, "__iter__"):
        raise ValueError(f"layer_specs: expected an iterable of LayerCacheSpec (see "
                         f"policy.resolve_model), got {type(layer_specs).__name__}")
    specs: tuple[LayerCacheSpec, ...] = tuple(layer_specs)
    if not specs:
        raise ValueError("layer_specs: expected at least one layer")
    if not all(isinstance(s, LayerCacheSpec) for s in specs):
        raise ValueError("layer_specs: expected LayerCacheSpec entries (see policy.resolve_model)")
    indices = [s.layer_index for s in specs]
    if len(set(indices)) != len(indices):
        raise ValueError(f"layer_specs: duplicate layer indices in {indices}")
    orphans = [s.layer_index for s in specs if s.kv_source is not None and s.kv_source not in indices]
    if orphans:
        raise ValueError(f"layer_specs: layers {orphans} read another layer's KV (kv_source) "
                         "that is not among the specs")
    by_index = {s.layer_index: s for s in specs}
    for s in specs:  # a KV-sharing layer reads its source's rows: same entry and format
        src = by_index.get(s.kv_source)
        if src is not None and (s.L, s.R, s.format.name, s.storage_dtype) != \
                (src.L, src.R, src.format.name, src.storage_dtype):
            raise ValueError(f"layer_specs: layer {s.layer_index} reads layer {src.layer_index}'s KV cache "
                             f"(kv_source) but its entry L={s.L} R={s.R} {s.format.name} differs from layer "
                             f"{src.layer_index}'s L={src.L} R={src.R} {src.format.name}")
    sizes = {s.block_size for s in specs}
    if len(sizes) != 1:
        raise ValueError(
            f"layer_specs: all layers must share one block_size (block ids are shared); "
            f"got {sorted(sizes)}"
        )
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0 \
            or memory_bytes > MAX_MEMORY_BYTES:
        shown = (f"an integer of {memory_bytes.bit_length()} bits"
                 if isinstance(memory_bytes, int) and memory_bytes > MAX_MEMORY_BYTES
                 else repr(memory_bytes))
        raise ValueError(f"memory_bytes: expected an integer > 0 and <= {MAX_MEMORY_BYTES:,} "
                         f"(int64 bytes), got {shown}")
    ispecs = _check_index_specs(index_specs, specs)
    # A layer that reads another layer's cache (KV sharing) takes no page of its own.
    pages = [0 if s.kv_source is not None else s.page_bytes(alignment) for s in specs]
    ipages = [s.page_bytes(alignment) for s in ispecs]
    for s, page in zip(specs + ispecs, pages + ipages):
        if page % s.storage_dtype.itemsize:
            raise ValueError(
                f"alignment: {alignment} gives layer {s.layer_index} a {page}-byte page, not a "
                f"multiple of its {s.storage_dtype} element size"
            )

    # Padding between regions is under REGION_ALIGN per layer, so the estimate
    # from the per-block cost is at most a few blocks high; step down to fit.
    # At most MAX_NUM_BLOCKS (int32 block ids): the loop below and every later
    # use of the count are then bounded whatever the budget.
    affordable = memory_bytes // sum(pages + ipages)
    num_blocks = min(affordable, MAX_NUM_BLOCKS)
    while num_blocks > 0 and _layout(specs, pages + ipages, num_blocks)[2] > memory_bytes:
        num_blocks -= 1
    if num_blocks == 0:
        need = _layout(specs, pages + ipages, 1)[2]
        raise ValueError(
            f"memory_bytes: {memory_bytes:,} bytes cannot hold even one block for "
            f"{len(specs)} layers ({need:,} bytes needed)"
        )
    offsets, region_bytes, used = _layout(specs, pages + ipages, num_blocks)
    index_layers = tuple(
        LayerPlan(layer_index=s.layer_index, format_name=f"index {s.format.name}",
                  quant_mode="FP8_PER_TOKEN" if s.format.quantized else "NONE", skip_reason=None,
                  bytes_per_token=s.bytes_per_token, page_bytes=page, shape=s.cache_shape(num_blocks),
                  dtype=s.storage_dtype, bytes=size, offset=off)
        for s, page, off, size in zip(ispecs, ipages, offsets[len(specs):], region_bytes[len(specs):]))
    owner = {s.layer_index: off for s, off in zip(specs, offsets)}
    offsets = [owner.get(s.kv_source, off) if s.kv_source is not None else off
               for s, off in zip(specs, offsets[:len(specs)])]
    # The cap, not the budget, decided the count.
    limited = affordable > MAX_NUM_BLOCKS and num_blocks == MAX_NUM_BLOCKS
    layers = tuple(
        LayerPlan(
            layer_index=s.layer_index,
            format_name=s.format.name,
            quant_mode=s.quant_mode.name,
            skip_reason=s.skip_reason,
            bytes_per_token=s.bytes_per_token,
            page_bytes=page,
            shape=s.cache_shape(num_blocks),
            dtype=s.storage_dtype,
            bytes=size,
            offset=off,
            kv_source=s.kv_source,
        )
        for s, page, off, size in zip(specs, pages, offsets, region_bytes)
    )
    return PoolPlan(num_blocks, specs[0].block_size, layers, used, memory_bytes, alignment,
                    block_id_limited=limited, index_layers=index_layers)


def _check_index_specs(index_specs, specs) -> tuple:
    if isinstance(index_specs, (str, bytes)) or not hasattr(index_specs, "__iter__"):
        raise ValueError(f"index_specs: expected an iterable of IndexCacheSpec, got {type(index_specs).__name__}")
    ispecs = tuple(index_specs)
    if not all(isinstance(s, IndexCacheSpec) for s in ispecs):
        raise ValueError("index_specs: expected IndexCacheSpec entries (mla_ext.sparse.index_cache)")
    known = {s.layer_index for s in specs}
    idx = [s.layer_index for s in ispecs]
    if len(set(idx)) != len(idx) or not set(idx) <= known:
        raise ValueError(f"index_specs: expected distinct layer indices among the latent layers' {sorted(known)}, "
                         f"got {idx}")
    bad = [s.block_size for s in ispecs if s.block_size != specs[0].block_size]
    if bad:
        raise ValueError(f"index_specs: block_size must be the latent cache's {specs[0].block_size} (block ids are "
                         f"shared), got {bad[0]}")
    return ispecs


def plan_model(cache_config, model_config, memory_bytes: int, alignment: int | None = None):
    """Resolve every layer of `model_config` under `cache_config`, then plan the pool
    (at most MAX_NUM_BLOCKS blocks: int32 block ids)."""
    check_configs(cache_config, model_config)
    plan = plan_pool(resolve_model(cache_config, model_config), memory_bytes, alignment)
    if model_config.non_mla_layers:  # allocate() keeps layer indices (None: no MLA cache)
        plan = replace(plan, num_model_layers=model_config.num_layers)
    return plan


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def render_plan(model_config, cache_config, memory_bytes: int, alignment: int | None = None,
                as_json: bool = False) -> str:
    """The plan of a whole model as the CLI prints it: a titled table, or JSON with the
    model and cache config beside the plan. ValueError on any bad input."""
    m, c = model_config, cache_config
    plan = plan_model(c, m, memory_bytes, alignment)
    if check_bool(as_json, "as_json"):
        doc = {
            "model": {"name": m.name, "L": m.L, "R": m.R, "P": m.P, "V": m.V,
                      "num_heads": m.num_heads, "num_layers": m.num_layers,
                      "model_dtype": _dtype_name(m.model_dtype),
                      "model_dtype_source": m.dtype_source,
                      "softmax_scale": m.softmax_scale,
                      "softmax_scale_source": m.softmax_scale_source,
                      "max_model_len": m.max_model_len,
                      "sliding_window_layers": sorted(m.sliding_window_layers)},
            "cache_config": {"kv_cache_dtype": c.kv_cache_dtype,
                             "skip_layers": list(c.skip_layers),
                             "block_size": c.block_size,
                             "calculate_kv_scales": c.calculate_kv_scales},
            **plan.to_dict(),
        }
        return json.dumps(doc, indent=2)
    skips = " ".join(str(e) for e in c.skip_layers) or "none"
    title = (
        f"{m.name}: L={m.L} R={m.R} layers={m.num_layers} dtype={_dtype_name(m.model_dtype)} | "
        f"kv_cache_dtype={c.kv_cache_dtype} skip_layers={skips} block_size={c.block_size}"
    )
    notes = (f"model dtype {_dtype_name(m.model_dtype)}: {m.dtype_source}\n"
             f"softmax scale {m.softmax_scale:.5f}: {m.softmax_scale_source}")
    return plan.format_table(title) + "\n" + notes
