"""The Pallas kernel calls a traced program makes: tests that check which operands a kernel
reads (a weight stack read in place, not a per-layer slice) find its call in the jaxpr."""

from __future__ import annotations

import jax


def pallas_calls(jaxpr, name: str):
    """The ``pallas_call`` equations of ``jaxpr`` (a ClosedJaxpr's ``.jaxpr``, or a Jaxpr) whose
    kernel is named ``name``, inside loops and other nested jaxprs too, in program order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call" and name in str(eqn.params):
            yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from pallas_calls(sub, name)
