"""The command-line form of a fault: errors that name the problem, and a round trip."""

import pytest

from sdcguard.fault_model import Fault, parse_spec


@pytest.mark.parametrize(
    "spec, message",
    [
        ("site=a:scores", "missing the field 'kind'"),
        ("kind=nan", "missing the field 'site'"),
        ("site=a:scores,kind=nan,colour=red", "unknown field 'colour'"),
        ("site=a:scores,kind=nan,index=x", "field 'index' of fault spec must be int"),
        ("site=a:scores,kind=boom", "unknown fault kind 'boom'"),
        ("site=a:scores,kind=bitflip,bit=80", "bit < 64"),
        ("site=a:scores,nan", "not 'field=value'"),
        ("site=nocolon,kind=nan", "malformed site name"),
        ("site=a:nope,kind=nan", "valid sites:\n  a:scores"),
    ],
)
def test_bad_spec_names_the_problem(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_spec(spec, valid_sites=["a:scores"])


def test_spec_round_trip():
    fault = parse_spec("site=d/b1/attn:scores,kind=bitflip,bit=27,index=17,step=0")
    assert fault == Fault(site="d/b1/attn:scores", kind="bitflip", bit=27, index=17, step=0)
