"""No code path unpickles untrusted data: every ``torch.load`` in the package passes ``weights_only=True`` (found by
reading the source, so a new call without it fails here), and a checkpoint shard holding a pickled object is
refused rather than executed."""

from __future__ import annotations

import ast
import os

import pytest
import torch

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "lightning_moe")


def _loads():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                            and node.func.attr == "load" and getattr(node.func.value, "id", None) == "torch":
                        yield path, node


def test_every_torch_load_is_weights_only():
    calls = list(_loads())
    assert calls, "the scan found no torch.load at all: it is not reading the package"
    unsafe = [f"{os.path.relpath(p, PACKAGE)}:{n.lineno}" for p, n in calls
              if not any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                         for k in n.keywords)]
    assert not unsafe, f"torch.load without weights_only=True: {unsafe}"


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_pickled_object_in_a_shard_is_refused(tmp_path, capfd):
    from lightning_moe.strategy.checkpoint import _load_shard
    path = tmp_path / "shard_00000.pt"
    torch.save({"state": _Payload()}, path)
    with pytest.raises(ValueError, match=r"shard_00000.pt is corrupted or truncated and cannot be loaded: .*"
                                         r"(?i:weights_only|unsupported global)"):
        _load_shard(path)
    assert "pwned" not in capfd.readouterr().out  # never executed
