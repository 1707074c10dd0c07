"""Graph capture as ``jax.jit``: compile a step ahead of time per batch-size bucket, replay the executable."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax

from engine_plugin_sdk import GraphCapture

logger = logging.getLogger(__name__)


class JaxGraphCapture(GraphCapture):
    """Lowers and compiles ``fn`` for each bucket's example inputs; :meth:`run` replays the executable.

    A compiled executable takes its inputs as arguments on every call, so a replay can never read stale
    inputs. ``fn`` must be traceable by JAX (written with ``jax.numpy``); a function JAX cannot trace
    (torch code, say) is not captured and always runs eagerly, the interface's documented fallback.
    """

    def __init__(self) -> None:
        self._fn: Callable[..., Any] | None = None
        self._compiled: dict[int, Any] = {}
        self.fallback_reason = ""

    def capture(self, fn: Callable[..., Any], batch_sizes: list[int], make_inputs: Callable[[int], tuple]) -> None:
        self._fn = fn
        self._compiled = {}
        jitted = jax.jit(fn)
        for size in batch_sizes:
            try:
                self._compiled[size] = jitted.lower(*make_inputs(size)).compile()
            except (TypeError, jax.errors.JAXTypeError, jax.errors.TracerArrayConversionError) as exc:
                # not JAX code: nothing can be captured, so run every bucket eagerly
                self.fallback_reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
                logger.info("jit capture of %s failed, running it eagerly: %s", getattr(fn, "__name__", fn), self.fallback_reason)
                self._compiled = {}
                return

    def run(self, batch_size: int, *inputs: Any) -> Any:
        if self._fn is None:
            raise RuntimeError("run() called before capture()")
        compiled = self._compiled.get(batch_size)
        if compiled is None:
            return self._fn(*inputs)
        return compiled(*inputs)

    def captured_batch_sizes(self) -> list[int]:
        return sorted(self._compiled)
