"""Site names and the fault model shared by every part of sdcguard.

A *site* is a named tensor produced inside training. Its name is the Flax module path joined
by ``/``, then ``:`` and the site inside the module, e.g. ``decoder/block_2/attn:scores``.
Backward sites append ``.grad_lhs`` / ``.grad_rhs`` for the two gradient GEMMs of a forward
GEMM (``decoder/block_2/attn:scores.grad_lhs``). Any other module's output is ``path:output``.

Inside jitted code a site is identified by :func:`site_id`, a stable 31-bit hash of its name,
so that a fault plan can target any site with data instead of code (one compilation for a
whole campaign).
"""

from __future__ import annotations

import enum
import functools
import re
import zlib
from collections.abc import Iterable, Sequence

# The GEMM sites of one attention layer, in execution order.
GEMM_SITES = ("query", "key", "value", "scores", "context", "out")
# `probs` is protected by the softmax invariant (every unmasked row sums to 1), not a GEMM.
ATTENTION_SITES = ("query", "key", "value", "scores", "probs", "context", "out")
GRAD_SUFFIXES = (".grad_lhs", ".grad_rhs")

# The paper's near-INF cut-off (ATTNChecker): |x| > 1e10.
NEAR_INF = 1e10


class FaultKind(enum.IntEnum):
    """What a fault does to one element. The integer is the code used inside fault plans."""

    INF = 0
    NEG_INF = 1
    NAN = 2
    NEAR_INF = 3  # a finite value >= 1e10, or the dtype's max where 1e10 does not fit
    BITFLIP = 4  # flip bit `bit` of the element's bit pattern
    VALUE = 5  # set the element to `param`
    SCALE = 6  # multiply the element by `param`

    @property
    def spec_name(self) -> str:
        return _KIND_NAMES[self]

    @classmethod
    def parse(cls, name: str) -> FaultKind:
        try:
            return _KINDS_BY_NAME[name]
        except KeyError:
            valid = ", ".join(_KINDS_BY_NAME)
            raise ValueError(f"unknown fault kind {name!r}; valid kinds: {valid}") from None


_KIND_NAMES = {
    FaultKind.INF: "inf",
    FaultKind.NEG_INF: "-inf",
    FaultKind.NAN: "nan",
    FaultKind.NEAR_INF: "near_inf",
    FaultKind.BITFLIP: "bitflip",
    FaultKind.VALUE: "value",
    FaultKind.SCALE: "scale",
}
_KINDS_BY_NAME = {v: k for k, v in _KIND_NAMES.items()}
FAULT_KINDS = tuple(_KIND_NAMES.values())


def site_name(module_path: Sequence[str], site: str) -> str:
    """Joins a module path and a site: ``(decoder, block_0, attn), 'scores'`` -> ``...:scores``."""
    return "/".join(module_path) + ":" + site


def split_site(name: str) -> tuple[str, str]:
    """Splits ``path:site`` into ``(path, site)``; raises ValueError on a malformed name."""
    path, sep, site = name.rpartition(":")
    if not sep or not site:
        raise ValueError(
            f"malformed site name {name!r}: expected 'module/path:site', "
            "e.g. 'decoder/block_0/attn:scores'"
        )
    return path, site


ROOT_MODULE = "model"  # the top-level module's path in site names (its own path is empty)
OUTPUT = "output"  # the site of a module's output: ``path:output``


def module_path_name(module_path: Sequence[str]) -> str:
    """``('decoder', 'block_0')`` -> ``'decoder/block_0'``; the root module is ``'model'``."""
    return "/".join(module_path) if module_path else ROOT_MODULE


def output_site_name(module_path: Sequence[str], index: int | None = None) -> str:
    """The site of a module's output: ``decoder/block_0/mlp:output`` (``:output.1`` for the
    second array of a module that returns several)."""
    return f"{module_path_name(module_path)}:{OUTPUT}" + ("" if index is None else f".{index}")


def is_output_site(name: str) -> bool:
    """Whether ``name`` is a module-output site (``path:output`` or ``path:output.i``)."""
    site = split_site(name)[1]
    return site == OUTPUT or (site.startswith(OUTPUT + ".") and site[len(OUTPUT) + 1 :].isdigit())


SITE_CLASSES = ("attention", "projection", "mlp", "head", "output", "other")
# The attention projections' module names: Flax linen and NNX (query ... out), Gemma
# (q_einsum, kv_einsum, attn_vec_einsum), Equinox (query_proj ... output_proj), Hugging Face.
_PROJECTIONS = (
    *("query", "key", "value", "out", "qkv", "proj", "o_proj", "q_proj", "k_proj", "v_proj"),
    *("q_einsum", "kv_einsum", "qkv_einsum", "attn_vec_einsum"),
    *("query_proj", "key_proj", "value_proj", "output_proj"),
)
_HEADS = ("head", "lm_head", "logit", "unembed")  # logit: logits, logitdense (Flax lm1b)
# An embedding's method that reads it as the output head (linen's Embed.attend, Gemma's decode).
_HEAD_METHODS = ("attend", "decode")
# Separators of a module path's components: linen/NNX ``a/b/0``, Equinox ``a.b[0]``.
_COMPONENTS = re.compile(r"[/.\[\]']+")


def site_class(name: str) -> str:
    """What part of a transformer a site is in, from its name.

    ``output`` (a module output), ``attention`` (the score and context GEMMs and the softmax:
    ``attn:scores``, ``attn:context``), ``projection`` (the query, key, value and output
    projections of an attention layer: ``attn/query``, ``attn/q_einsum``,
    ``attn.query_proj``), ``mlp`` (under a module named ``mlp...``), ``head`` (the output head
    or the embedding read as one: ``embed:attend``, ``embedder:decode``, ``head``,
    ``lm_head``, ``logits``), else ``other``. Module names match in any case (Flax's
    ``MlpBlock_0``), and paths may be written ``a/b/0`` (linen, NNX) or ``a.b[0]`` (Equinox).
    Backward sites share their forward site's class.

    Example:
      >>> site_class("decoder/block_0/attn/query:dot_general.grad_rhs")
      'projection'
      >>> site_class("layers[0].attn:scores")
      'attention'
    """
    if is_output_site(name):
        return "output"
    path, site = split_site(name)
    site = site.split(".grad_")[0]
    # Flax names unnamed modules by class: MlpBlock_0, MultiHeadDotProductAttention_0.
    parts = [p.lower() for p in _COMPONENTS.split(path) if p]
    if site in _HEAD_METHODS or any(p in _HEAD_METHODS or p.startswith(_HEADS) for p in parts):
        return "head"
    if any(p.startswith("mlp") for p in parts):
        return "mlp"
    if any("attn" in p or "attention" in p for p in parts):
        last = parts[-1]
        if site in _PROJECTIONS or last in _PROJECTIONS:
            return "projection"
        return "attention"
    return "other"


def backward_site_names(forward_site: str) -> tuple[str, str]:
    """The two gradient-GEMM sites of a forward GEMM site."""
    return tuple(forward_site + s for s in GRAD_SUFFIXES)  # type: ignore[return-value]


def site_id(name: str) -> int:
    """Stable non-negative int32 identifier of a site name (CRC-32, top bit cleared)."""
    sid = zlib.crc32(name.encode()) & 0x7FFFFFFF
    _NAMES_SEEN.setdefault(sid, name)
    return sid


# A cache, not state: the names whose ids this process computed, so that an error about a fault
# plan (which holds ids only) can name the site the user wrote.
_NAMES_SEEN: dict[int, str] = {}


def site_name_of(sid: int) -> str:
    """The name of a site id computed in this process by :func:`site_id`, else ``'#<id>'``."""
    return _NAMES_SEEN.get(int(sid), f"#{int(sid)}")


def attention_site_names(attn_path: Sequence[str] | str, *, backward: bool = True) -> list[str]:
    """Every site of one attention layer at ``attn_path``: forward, then backward GEMM sites."""
    path = attn_path.split("/") if isinstance(attn_path, str) else list(attn_path)
    names = [site_name(path, s) for s in ATTENTION_SITES]
    if backward:
        for s in GEMM_SITES:
            names.extend(backward_site_names(site_name(path, s)))
    return names


@functools.cache
def site_pattern(pattern: str) -> re.Pattern:
    """The regex of one pattern of the site grammar (see :func:`site_matches`), matched whole.

    ``*`` matches within one path component (not ``/`` or ``:``), ``**`` across components,
    ``?`` one character of a component; everything else is literal (``[`` too).

    Example:
      >>> bool(site_pattern("decoder/block_*/attn:scores*").fullmatch(
      ...     "decoder/block_1/attn:scores.grad_lhs"))
      True
    """
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        c = pattern[i]
        out.append("[^/:]*" if c == "*" else "[^/:]" if c == "?" else re.escape(c))
        i += 1
    return re.compile("".join(out))


def site_matches(pattern: str, name: str) -> bool:
    """Whether ``pattern`` selects the site ``name``: the one grammar of site patterns.

    ``ABFTConfig(include=..., exclude=...)`` and every ``--sites`` of the command line use it.
    ``*`` matches within one path component (it stops at ``/`` and ``:``), ``**`` across
    components, ``?`` one character; everything else is literal. A pattern matches whole
    names; one without ``:`` also names module paths and selects every site of the modules it
    matches.

    Example:
      >>> site_matches("decoder/block_*:output", "decoder/block_0/mlp:output")
      False
      >>> site_matches("decoder/**/mlp/*", "decoder/block_0/mlp/fc_in:dot_general.grad_rhs")
      True
      >>> site_matches("**attn**", "layers[0].attn:scores")
      True
      >>> site_matches("**scores.grad_rhs", "loss/attend:scores.grad_rhs")
      True
    """
    regex = site_pattern(pattern)
    if regex.fullmatch(name):
        return True
    return ":" not in pattern and regex.fullmatch(name.rpartition(":")[0]) is not None


def match_sites(pattern: str, names: Iterable[str]) -> list[str]:
    """The names (in their order) that ``pattern`` selects (see :func:`site_matches`)."""
    return [n for n in names if site_matches(pattern, n)]
