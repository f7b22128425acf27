"""The decode step on CUDA as CUDA graphs (`GraphSteps`): a `kvrag.cpu.decode.FastDecoder`'s static step captured
once per set of cache buffers and replayed, one launch a token."""

from __future__ import annotations

from typing import Any

import torch


class GraphSteps:
    """A decoder's step on CUDA as one CUDA graph per set of cache buffers: every layer and the head replayed in
    one launch, so a token costs the GPU's work and not hundreds of kernel launches from Python.

    A graph is captured at the first step over a set of buffers (the step runs once eagerly on a side stream
    first, as a capture requires, and that run is the step's result) and replayed for every later step over the
    same buffers, in this answer and in later ones that reuse them (the executor pools its stitched caches). A
    graph writes to its buffers' addresses, so it holds the buffers: the KEPT most recent graphs keep theirs
    alive after their answers (a cache of another size or a plain prefill's cache brings new buffers and a new
    graph, and the oldest graph and its buffers are let go).
    """

    KEPT = 2

    def __init__(self, decoder: Any) -> None:  # a kvrag.cpu.decode.FastDecoder (it imports this module)
        self.decoder = decoder
        self.graphs: dict[tuple[Any, ...], _Graph] = {}
        self.captures = 0  # graphs captured so far (a replay captures nothing)

    def __call__(
        self,
        token: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        filled: int,
    ) -> torch.Tensor:
        key = (tuple(t.data_ptr() for t in (*keys, *values)), keys[0].shape, keys[0].stride(), keys[0].dtype)
        graph = self.graphs.pop(key, None)
        if graph is not None:
            self.graphs[key] = graph  # the most recent last
            return graph.replay(token, cos, sin, filled)
        graph = _Graph(self.decoder, keys, values)
        logits = graph.capture(token, cos, sin, filled)
        self.captures += 1
        self.graphs[key] = graph
        while len(self.graphs) > self.KEPT:
            del self.graphs[next(iter(self.graphs))]
        return logits


class _Graph:
    """One captured step over one set of cache buffers, and its static inputs and output."""

    def __init__(self, decoder: Any, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        device = keys[0].device
        self.decoder, self.keys, self.values = decoder, keys, values
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.cos = torch.zeros(decoder.head_dim, dtype=decoder.embed.dtype, device=device)
        self.sin = torch.zeros_like(self.cos)
        self.graph = torch.cuda.CUDAGraph()
        self.logits = torch.empty(0)

    def _inputs(self, token: int, cos: torch.Tensor, sin: torch.Tensor, filled: int) -> None:
        self.token.fill_(token)
        self.slot.fill_(filled)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def _run(self) -> torch.Tensor:
        return self.decoder.static_step(self.token, self.cos, self.sin, self.keys, self.values, self.slot)

    def capture(self, token: int, cos: torch.Tensor, sin: torch.Tensor, filled: int) -> torch.Tensor:
        """This step's logits, from an eager run on a side stream; then the graph of the same step."""
        self._inputs(token, cos, sin, filled)
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            logits = self._run().clone()  # writes this token's key and value: the capture below writes nothing
        current.wait_stream(side)
        with torch.cuda.graph(self.graph):
            self.logits = self._run()
        return logits

    def replay(self, token: int, cos: torch.Tensor, sin: torch.Tensor, filled: int) -> torch.Tensor:
        self._inputs(token, cos, sin, filled)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the graph's own output
