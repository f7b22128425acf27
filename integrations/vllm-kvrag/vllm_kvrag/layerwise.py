"""A step's stored KV written into vLLM's caches a layer at a time, beside the forward (torch only).

vLLM calls a connector's `wait_for_layer_load(layer)` inside each attention layer, right before that layer reads its
cache. `LayerPipeline` runs a load's preparation (the store reads and checks) and then one write a layer, in layer
order, on a thread of its own and, on CUDA, on a stream of its own; the forward's layer l waits for layer l only.
So the host-to-device copy, the keys' rotation and the write of layer l + 1 run while layer l computes, and the
first attention waits for the reads and layer 0's write, not for every layer's.

Every entry of the step is read and checked before layer 0 is written: an entry's checksum covers all its layers, and
no layer of an entry is written before the whole entry is known good.

On CUDA, `wait` makes the forward's current stream wait for the layer's event (the host does not block on the copy);
on CPU it blocks until the layer is written. A preparation or a write that fails sets every layer ready (the forward
is never left waiting) and is reported by `join`; the caller marks the step's loads failed, and vLLM computes those
tokens again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch


class LayerPipeline:
    """One step's writes, layer after layer, on a thread (and CUDA stream) of their own (module docstring)."""

    def __init__(self, layers: Sequence[int], device: torch.device, name: str = "kvrag-layers") -> None:
        self.layers = list(layers)  # the order they are written in: the forward's
        self.device = device
        self._ready = {i: threading.Event() for i in self.layers}
        self._events: dict[int, torch.cuda.Event] = {}
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # the forward's stream, taken on the forward's thread (a stream is current per thread)
        self._forward = torch.cuda.current_stream(device) if self._stream is not None else None
        self._name = name
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.written: list[int] = []  # the layers written, in order

    def start(self, write: Callable[[int], None], prepare: Callable[[], None] | None = None) -> None:
        """Run `prepare()`, then `write(layer)` for each layer in order, beside the caller."""
        self._thread = threading.Thread(target=self._run, args=(write, prepare), name=self._name, daemon=True)
        self._thread.start()

    def _run(self, write: Callable[[int], None], prepare: Callable[[], None] | None) -> None:
        try:
            if self._stream is not None and self._forward is not None:
                # the writes start after whatever the forward's stream has queued (the blocks' zeroing, say)
                self._stream.wait_stream(self._forward)
            stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
            with torch.inference_mode(), stream:
                if prepare is not None:
                    prepare()
                for layer in self.layers:
                    write(layer)
                    if self._stream is not None:
                        event = torch.cuda.Event()
                        event.record(self._stream)
                        self._events[layer] = event
                    self.written.append(layer)
                    self._ready[layer].set()
        except BaseException as err:  # noqa: BLE001 - reported by join(); the forward must never wait forever
            self.error = err
        finally:
            for ready in self._ready.values():
                ready.set()

    def wait(self, layer: int) -> None:
        """Called by the forward's thread before layer `layer` reads its cache; a layer not loaded here returns."""
        ready = self._ready.get(layer)
        if ready is None:
            return
        ready.wait()
        event = self._events.get(layer)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def join(self) -> BaseException | None:
        """Wait for every layer (the forward's stream too, on CUDA); the error that stopped the writes, if any."""
        if self._thread is not None:
            self._thread.join()
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return self.error

