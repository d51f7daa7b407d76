"""The train thread's context (``raytrain.backend._TrainThreadContext``) on a train function
that raised: the error Ray Train keeps must not keep the function's model alive.

Held, the model's FSDP groups could not be freed at shutdown: every worker of a failed run
warned "shutdown_mesh(): the process group(s) ... are still referenced ... Drop those
references (del model)", advice a Ray Train user cannot follow, and the groups' threads
lived to interpreter exit, where gloo can abort the process. No Ray, no mesh: the context
with nothing to enter but itself."""

from __future__ import annotations

import gc
import traceback
import weakref


class _Model:
    pass


def test_a_failed_train_function_leaves_its_locals_to_be_freed_and_its_traceback_whole():
    from ray_mesh.raytrain.backend import _TrainThreadContext

    refs: list[weakref.ref] = []

    def train_loop() -> None:
        model = _Model()
        refs.append(weakref.ref(model))
        try:
            raise KeyError("shard 3")
        except KeyError as inner:
            raise ValueError("bad batch") from inner

    kept = None
    try:
        with _TrainThreadContext():
            train_loop()
    except ValueError as exc:
        kept = exc  # what Ray Train holds on to, to report
    gc.collect()
    assert refs[0]() is None, "the failed function's model is still held by its error"
    text = "".join(traceback.format_exception(kept))
    for part in ("in train_loop", 'raise ValueError("bad batch") from inner', "bad batch",
                 "KeyError: 'shard 3'", 'raise KeyError("shard 3")'):
        assert part in text, (part, text)
