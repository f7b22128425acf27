"""What kvrag keeps for one model object: the CPU engine's switches, its fast decoder and the model's lock, in one
record (`ModelState`) found in one place (`of`).

Nothing is set on the model or its modules: the records are kept here, by model object, and go with it when it is
collected. One model object has one record, whatever number of runtimes use it, because what it describes belongs
to the model (its swapped modules, the decoder over its weights, one forward at a time on it); a runtime holds its
model's record (`ModelRuntime.cpu_state`). It never decides what the switches do: `kvrag.cpu` and
`kvrag.cpu.decode` read them.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from kvrag.errors import InvalidRequestError


@dataclass(slots=True, eq=False)
class ModelState:
    """One model object's CPU engine switches, its fast decoder and its lock."""

    kernels: bool = True  # the CPU engine may take the model's work (`kvrag.cpu.install(model, enabled=False)`)
    decode_weights: str = "model"  # what the C decode step reads: "model", "int8" or "int4"
    compile_decode: bool = False  # decode through the compiled torch step (`kvrag.cpu.decode.compile_decoding`)
    native_decode: bool = True  # decode through the whole step in one call: C on CPU, a CUDA graph on CUDA
    decoder: Any = None  # the model's `kvrag.cpu.decode.FastDecoder`, made at its first decoded token
    claimed: bool = False  # whether a runtime set the switches above (`kvrag.cpu.attach`): later ones ask the same
    lock: threading.RLock = field(default_factory=threading.RLock)  # one forward at a time on the model

    def settings(self) -> dict[str, Any]:
        """The switches a runtime is built with, by its arguments' names."""
        return {
            "cpu_kernels": self.kernels,
            "compile_decode": self.compile_decode,
            "decode_weights": self.decode_weights,
        }

    def check(self, **asked: Any) -> None:
        """Raise InvalidRequestError where a runtime asks, for a model another runtime already uses, for switches
        other than those the model has now (`settings`): one of them would otherwise change the other's."""
        held = self.settings()
        differ = [name for name, value in asked.items() if held[name] != value]
        if differ:
            given = ", ".join(f"{name}={asked[name]!r}" for name in differ)
            has = ", ".join(f"{name}={held[name]!r}" for name in differ)
            raise InvalidRequestError(
                f"this model object is already used by a runtime with {has}, and a second one asks for {given}: "
                "every runtime on one model object shares its CPU engine state, so ask for the same settings, or "
                "give the second one its own copy of the model (copy.deepcopy(model), or load it again)"
            )


_STATES: weakref.WeakKeyDictionary[Any, ModelState] = weakref.WeakKeyDictionary()
_GUARD = threading.Lock()  # two threads asking for a new model's record make one


def of(model: Any) -> ModelState:
    """`model`'s record, made on first use with the defaults (the engine on, the model's own weights, eager)."""
    state = _STATES.get(model)
    if state is None:
        with _GUARD:
            state = _STATES.get(model)
            if state is None:
                state = _STATES[model] = ModelState()
    return state
