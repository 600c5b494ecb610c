"""The command-line form of a fault: ``site=...,kind=...,index=...,step=...``."""

from __future__ import annotations

from collections.abc import Sequence

from sdcguard.fault_model._plan import Fault
from sdcguard.fault_model._sites import split_site

_SPEC_FIELDS = {"site", "kind", "index", "seed", "step", "bit", "value"}
_CONVERSIONS = (("index", int), ("seed", int), ("step", int), ("bit", int), ("value", float))


def parse_spec(spec: str, *, valid_sites: Sequence[str] | None = None) -> Fault:
    """Parses ``site=S,kind=K[,index=I][,seed=N][,step=T][,bit=B][,value=V]`` into a Fault.

    Raises:
      ValueError: naming the bad field (and listing the valid sites when the site is unknown).

    Example:
      >>> parse_spec("site=m/attn:scores,kind=bitflip,bit=27,index=4")
      Fault(site='m/attn:scores', kind='bitflip', index=4, seed=0, step=-1, bit=27, value=0.0)
    """
    fields: dict[str, str] = {}
    for part in spec.split(","):
        name, sep, val = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"malformed fault spec {spec!r}: {part!r} is not 'field=value'")
        if name not in _SPEC_FIELDS:
            raise ValueError(
                f"unknown field {name!r} in fault spec; valid fields: {sorted(_SPEC_FIELDS)}"
            )
        if name in fields:  # a repeated field would silently replace the first one
            raise ValueError(f"fault spec {spec!r} gives the field {name!r} twice")
        fields[name] = val.strip()
    for required in ("site", "kind"):
        if required not in fields:
            raise ValueError(f"fault spec {spec!r} is missing the field {required!r}")
    split_site(fields["site"])
    if valid_sites is not None and fields["site"] not in valid_sites:
        listing = "\n  ".join(valid_sites)
        raise ValueError(
            f"unknown site {fields['site']!r} in field 'site'; valid sites:\n  {listing}"
        )
    kwargs: dict = {"site": fields["site"], "kind": fields["kind"]}
    for name, conv in _CONVERSIONS:
        if name in fields:
            try:
                kwargs[name] = conv(fields[name])
            except ValueError:
                raise ValueError(
                    f"field {name!r} of fault spec must be {conv.__name__}, got {fields[name]!r}"
                ) from None
    try:
        return Fault(**kwargs)
    except ValueError as e:
        raise ValueError(f"bad fault spec {spec!r}: {e}") from None
