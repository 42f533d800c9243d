"""Are two identical plain runs of ``tests/test_gpu_optimizer.py``'s model bit-identical, and how far is the
distributed optimizer (and the fused write-back) from them after one step? Separates run-to-run nondeterminism from
a path's own difference. One GPU; prints one line (the worst main-weight relative-norm difference of each).

    PYTHONPATH=. python benchmarks/probe_optimizer_repeat.py
"""

import pathlib
import tempfile

from tests.test_gpu_optimizer import _Mains, _fit, _worst


def main() -> None:
    res = {}
    for name, kw in (("plain_a", dict(fused_optimizer_writeback=False)),
                     ("plain_b", dict(fused_optimizer_writeback=False)),
                     ("dist", dict(distributed_optimizer=True, fused_optimizer_writeback=False)), ("fused", {})):
        m = _Mains()
        _fit(pathlib.Path(tempfile.mkdtemp()), steps=1, callbacks=[m], **kw)
        res[name] = m.mains
    print("REPEAT plain vs plain", _worst(res["plain_b"], res["plain_a"]), "dist vs plain",
          _worst(res["dist"], res["plain_a"]), "fused vs plain", _worst(res["fused"], res["plain_a"]))


if __name__ == "__main__":
    main()
