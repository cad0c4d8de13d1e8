"""What a run captured, from its milestones: model, vLLM, layers, hidden size, dtype, tokens, files, bytes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


class MilestoneLike(Protocol):
    """The attributes of a stored milestone the card and the charts read."""

    kind: str
    fields: dict[str, Any]
    at: float


@dataclass(frozen=True)
class CaptureCard:
    """The capture card of a run page; None fields were not reported (yet)."""

    model: str | None
    vllm: str | None
    layers: list[int] | None
    convention: str | None
    hidden_size: int | None
    dtype: str | None
    tokens: int | None
    files: int | None
    bytes: int | None
    final: bool  # totals from the `completed` milestone, not a running count
    forecast_bytes: int | None = None  # what the job forecast it would write (its `forecast` milestone)
    free_bytes: int | None = None  # free space of the output directory, latest reading
    fits: bool | None = None
    eta_s: float | None = None  # from the measured tokens/s; None once the run is over
    # what the output checker read in the latest file checked, tensor name: "[T, 3, 128]"
    shapes: dict[str, str] | None = None
    expected_shape: str | None = None  # hidden_states as configured: [T, layers, hidden size]

    @property
    def shape_differs(self) -> bool:
        """Whether the hidden states read differ from the configured ones."""
        read = (self.shapes or {}).get("hidden_states")
        return read is not None and self.expected_shape is not None and read != self.expected_shape


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _latest(value: Any, kept: int | None) -> int | None:
    """``value`` when it is an int (the latest report wins), else what was ``kept``."""
    return kept if _int(value) is None else value


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def shape_text(shape: list[Any]) -> str:
    """A tensor shape with its token axis (the first) as T: ``[T, 3, 128]``."""
    return "[" + ", ".join(["T", *(str(d) for d in shape[1:])]) + "]" if shape else "[]"


def _shapes(raw: Any) -> dict[str, str] | None:
    if not isinstance(raw, dict):
        return None
    return {str(k): shape_text(v) for k, v in raw.items() if isinstance(v, list)} or None


def capture_card(spec: Mapping[str, Any], milestones: Iterable[MilestoneLike]) -> CaptureCard | None:
    """The card of a run whose job reported its capture (None before that, and for a watched command that
    never does: eaglewatch's own job, or any job printing the same milestone lines).

    Later milestones win: a resumed job reports its configuration again. Tokens count captured batches
    until `completed` gives the totals (which include samples already valid from an earlier attempt).
    """
    vllm = layers = convention = hidden = dtype = None
    tokens = files = nbytes = None
    forecast_bytes = free = eta = None
    fit: bool | None = None
    shapes: dict[str, str] | None = None
    batch_tokens, seen, final = 0, False, False
    for m in milestones:
        f = m.fields
        if m.kind == "engine_config":
            # the job's own engine_config says "vllm"; the rules reading vLLM's log lines say "version"
            vllm = _str(f.get("vllm")) or _str(f.get("version")) or vllm
        elif m.kind == "capture_configured":
            seen = True
            raw = f.get("layers")
            layers = [x for x in raw if _int(x) is not None] if isinstance(raw, list) else layers
            convention = _str(f.get("convention")) or convention
            hidden = _int(f.get("hidden_size")) or hidden
            dtype = _str(f.get("dtype")) or dtype
        elif m.kind in ("shape_check_passed", "shape_check_failed"):
            shapes = _shapes(f.get("shapes")) or shapes
        elif m.kind == "batch_captured":
            batch_tokens += _int(f.get("tokens")) or 0
        elif m.kind == "forecast":
            seen, forecast_bytes = True, _int(f.get("bytes"))
            free = _latest(f.get("free_bytes"), free)
            fit = f.get("fits") if isinstance(f.get("fits"), bool) else fit
        elif m.kind == "progress":
            free = _latest(f.get("free_bytes"), free)
            eta = float(f["eta_s"]) if type(f.get("eta_s")) in (int, float) else None  # not a bool
            files = _latest(f.get("files_written"), files)
            nbytes = _latest(f.get("bytes_written"), nbytes)
        elif m.kind == "completed":
            final, eta = True, None
            tokens = _latest(f.get("tokens"), tokens)
            files = _latest(f.get("files"), files)
    if not seen:
        return None
    if not final:
        tokens = batch_tokens
    return CaptureCard(
        model=_str(spec.get("model")),
        vllm=vllm,
        layers=layers,
        convention=convention,
        hidden_size=hidden,
        dtype=dtype,
        tokens=tokens,
        files=files,
        bytes=nbytes,
        final=final,
        forecast_bytes=forecast_bytes,
        free_bytes=free,
        fits=fit,
        eta_s=eta,
        shapes=shapes,
        expected_shape=shape_text([0, len(layers), hidden]) if layers and hidden else None,
    )


def layer_rms_series(milestones: Iterable[MilestoneLike]) -> list[dict[str, Any]]:
    """[{"at", "rms": {layer id: RMS}}] from the `layer_rms` of progress milestones (the run page chart)."""
    out: list[dict[str, Any]] = []
    for m in milestones:
        rms = m.fields.get("layer_rms") if m.kind == "progress" else None
        if isinstance(rms, dict) and rms:
            clean = {
                str(k): float(v)
                for k, v in rms.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            if clean:
                out.append({"at": m.at, "rms": clean})
    return out


def sharded_capture_card(spec: Mapping[str, Any], milestones: Iterable[MilestoneLike]) -> CaptureCard | None:
    """The card of a sharded run: each shard's own card (from its milestones, attempts in order), then
    totals summed, final once every shard is, the slowest shard's ETA and the least free space."""
    by_shard: dict[Any, list[MilestoneLike]] = {}
    for m in milestones:  # tagged with its shard (MilestonePublic.shard)
        by_shard.setdefault(getattr(m, "shard", None), []).append(m)
    cards = [c for ms in by_shard.values() if (c := capture_card(spec, ms)) is not None]
    if not cards:
        return None

    def known(name: str) -> list[Any]:
        return [getattr(c, name) for c in cards if getattr(c, name) is not None]

    firsts = ("vllm", "layers", "convention", "hidden_size", "dtype", "shapes", "expected_shape")
    fits = known("fits")
    return CaptureCard(
        model=cards[0].model,
        **{name: next((getattr(c, name) for c in cards if getattr(c, name)), None) for name in firsts},
        tokens=sum(known("tokens")) if known("tokens") else None,
        files=sum(known("files")) if known("files") else None,
        bytes=sum(known("bytes")) if known("bytes") else None,
        final=all(c.final for c in cards) and len(cards) == len(by_shard),
        # a shard's forecast covers the whole run (README, sharding): the largest one is the run's
        forecast_bytes=max(known("forecast_bytes"), default=None),
        free_bytes=min(known("free_bytes"), default=None),
        fits=all(fits) if fits else None,
        eta_s=max(known("eta_s"), default=None),
    )
