"""One backend registry for every op with more than one implementation.

In the style of xformers' attention dispatch: each backend states
`not_supported_reasons(inputs)`; the dispatcher picks the first backend (in
priority order) with none, otherwise raises one error listing every backend's
reasons. The choice is inspectable (`explain`) and can be forced, for tests
and benchmarks, with `Dispatcher.force(name)` or the environment variable
MLA_EXT_FORCE_<OP>=<backend> (e.g. MLA_EXT_FORCE_GATHER=triton).

A backend named "triton" or "triton_<...>" runs Triton kernels: besides its
own reasons it reports those of the installed Triton itself, which matter
under TRITON_INTERPRET=1 (`mla_ext.compat.triton_interpreter_reasons`: e.g. an
interpreter that this numpy breaks), so the dispatcher falls back to the next
backend instead of failing inside the kernel.

Imports nothing from the rest of the package except mla_ext.compat (which
imports nothing either), lazily.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator


class NoBackendError(ValueError):
    """No backend can serve the inputs; the message lists every backend's reasons."""


@dataclass(frozen=True)
class Backend:
    """A named implementation.

    `reasons(inputs)` returns a list of human-readable reasons why this backend
    cannot serve `inputs` (empty list: it can). `run(inputs)` does the work.
    """

    name: str
    reasons: Callable[[Any], list[str]]
    run: Callable[[Any], Any]

    def not_supported_reasons(self, inputs: Any) -> list[str]:
        why = list(self.reasons(inputs))
        if is_triton_backend(self.name):
            from mla_ext.compat import triton_interpreter_reasons

            why += triton_interpreter_reasons()  # [] unless interpreting; probed once
        return why


def is_triton_backend(name: str) -> bool:
    """The naming convention for backends that run Triton kernels."""
    return name == "triton" or name.startswith("triton_")


class Dispatcher:
    def __init__(self, op: str, backends: list[Backend] | None = None):
        self.op = op
        self._backends: list[Backend] = list(backends or [])
        self._forced: str | None = None

    # -- registry ---------------------------------------------------------
    def register(self, backend: Backend) -> Backend:
        if any(b.name == backend.name for b in self._backends):
            raise ValueError(f"{self.op}: backend {backend.name!r} is already registered")
        self._backends.append(backend)
        return backend

    @property
    def backends(self) -> list[Backend]:
        return list(self._backends)

    def get(self, name: str) -> Backend:
        for b in self._backends:
            if b.name == name:
                return b
        raise ValueError(
            f"{self.op}: unknown backend {name!r}; expected one of "
            f"{[b.name for b in self._backends]}"
        )

    # -- choice -----------------------------------------------------------
    def _forced_name(self) -> str | None:
        env = os.environ.get(f"MLA_EXT_FORCE_{self.op.upper()}")
        return self._forced or (env or None)

    def reasons_by_backend(self, inputs: Any) -> dict[str, list[str]]:
        return {b.name: b.not_supported_reasons(inputs) for b in self._backends}

    def choose(self, inputs: Any) -> Backend:
        forced = self._forced_name()
        if forced is not None:
            b = self.get(forced)
            why = b.not_supported_reasons(inputs)
            if why:
                raise NoBackendError(
                    f"{self.op}: forced backend {forced!r} cannot serve these inputs: "
                    + "; ".join(why)
                )
            return b
        all_reasons = {}
        for b in self._backends:
            why = b.not_supported_reasons(inputs)
            if not why:
                return b
            all_reasons[b.name] = why
        lines = [f"  {name}: {'; '.join(why)}" for name, why in all_reasons.items()]
        raise NoBackendError(f"{self.op}: no backend supports these inputs:\n" + "\n".join(lines))

    def explain(self, inputs: Any) -> str:
        """One line per backend: chosen / usable / why not."""
        try:
            chosen = self.choose(inputs).name
        except NoBackendError:
            chosen = None
        out = [f"{self.op}: " + (f"uses {chosen!r}" if chosen else "no usable backend")]
        for b in self._backends:
            why = b.not_supported_reasons(inputs)
            mark = "*" if b.name == chosen else (" " if not why else "x")
            out.append(f"  [{mark}] {b.name}" + (f": {'; '.join(why)}" if why else ""))
        return "\n".join(out)

    def __call__(self, inputs: Any) -> Any:
        return self.choose(inputs).run(inputs)

    @contextlib.contextmanager
    def force(self, name: str | None) -> Iterator[None]:
        """Within the block, always use backend `name` (None: normal choice)."""
        if name is not None:
            self.get(name)
        prev, self._forced = self._forced, name
        try:
            yield
        finally:
            self._forced = prev
