"""Loaded by every Python process the suite starts (tests/conftest.py puts this folder first
on PYTHONPATH): compiled programs shared between the processes of one multi-process run.

jax can let the process holding a program's first device compile it and hand the binary to
the others through the coordination service (``jax_share_binary_between_hosts``), instead of
every process compiling the same program.  It matches the processes' programs by their
persistent-cache key, and on the CPU backend that key differs between the processes of one
run: it hashes the topology fingerprint of the process's own client.  Here the CPU key hashes
the program's devices (platform, kind, id and process) instead, the same in every process of a
run, so the processes agree on the key and share the binary.  Everything else in the key
(the program, the compile options, XLA's flags, jax's version) is unchanged; a program that
differs between processes still gets a key of its own.

Only when ``DISTFLOW_TEST_SHARE_BINARIES=1`` (set by tests/conftest.py with the suite's shared
cache, and dropped with it by ``conftest.without_shared_cache``), and only once jax's own
``cache_key`` module is imported: a process that never imports jax is untouched.
"""

import os
import sys

if os.environ.get("DISTFLOW_TEST_SHARE_BINARIES") == "1":
  import importlib.abc
  import importlib.util

  def _patch(cache_key):
    original = cache_key._hash_accelerator_config

    def hash_devices(hash_obj, devices):
      flat = list(devices.flat)
      if not flat or any(d.platform != "cpu" for d in flat):
        return original(hash_obj, devices)
      for d in flat:
        hash_obj.update(f"{d.platform}|{d.device_kind}|{d.id}|{d.process_index};".encode())

    cache_key._hash_accelerator_config = hash_devices

  class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches ``jax._src.cache_key`` right after it is first executed."""

    def find_spec(self, name, path=None, target=None):
      if name != "jax._src.cache_key":
        return None
      sys.meta_path.remove(self)
      spec = importlib.util.find_spec(name)
      if spec is None or spec.loader is None:
        return spec
      execute = spec.loader.exec_module

      def exec_module(module):
        execute(module)
        _patch(module)

      spec.loader.exec_module = exec_module
      return spec

  sys.meta_path.insert(0, _AfterImport())
