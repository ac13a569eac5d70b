"""What a peer does is a fact about a version: the behaviours our tests pin, per version range.

Each entry maps (distribution, behaviour) to version ranges (PEP 440 specifier sets) and the
behaviour recorded there. The upper end of the newest range is the newest version checked: a
newer release is not assumed to behave the same (it may have fixed the bug), so a test on an
unrecorded version skips with the behaviour to record, instead of failing. On a recorded
version the re-enactment must match the installed peer, or the test fails.
"""

from __future__ import annotations

import importlib.metadata

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: (distribution, behaviour) -> [(versions, value, where it was checked)]
PEER_FACTS: dict[tuple[str, str], list[tuple[str, str, str]]] = {
    # float64 -> float8_e4m3fn / float4_e2m1fn casts: rounded through float32 (twice), or once.
    ("ml_dtypes", "float64_cast"): [
        (">=0.5,<0.7", "through_float32", "0.6.0 (cpu-peers.md 2.1)"),
        (">=0.7.0,<=0.7.0", "once", "0.7.0: 2^-10*(1+2^-40) -> 0x01"),
    ],
    ("torch", "float64_cast"): [
        (">=2.8,<=2.13.0", "through_float32", "2.13.0+cpu"),
    ],
    # float32 -> float8_e4m3fn above 464 and +-inf: NaN (0x7F/0xFF) or saturate to +-448.
    ("ml_dtypes", "e4m3_overflow"): [(">=0.5,<=0.7.0", "nan", "0.6.0, 0.7.0")],
    ("torch", "e4m3_overflow"): [
        (">=2.8,<2.12", "nan", "2.11 on the H200 machine"),
        (">=2.13,<=2.13.0", "saturate", "2.13.0+cpu"),
    ],
}


def installed_version(dist: str) -> Version | None:
    """The installed version of ``dist`` without its local label (2.13.0+cpu -> 2.13.0)."""
    try:
        return Version(Version(importlib.metadata.version(dist)).base_version)
    except importlib.metadata.PackageNotFoundError:
        return None


def peer_fact(dist: str, behaviour: str) -> str:
    """The recorded ``behaviour`` of the installed ``dist``; skips when not installed or when
    this version has no record (say what to record)."""
    v = installed_version(dist)
    if v is None:
        pytest.skip(f"{dist} is not installed")
    for spec, value, _ in PEER_FACTS[(dist, behaviour)]:
        if v in SpecifierSet(spec):
            return value
    recorded = "; ".join(f"{s}: {val}" for s, val, _ in PEER_FACTS[(dist, behaviour)])
    pytest.skip(f"{dist} {v}: {behaviour} is not recorded for this version (recorded: "
                f"{recorded}); check it and add it to tests/peer_facts.py")
