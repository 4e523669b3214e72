"""Loading an older version of a kernel module beside the current one, for a same-process comparison.

A kernel module registers ``torch.library`` ops at import; importing an older copy would replace the
current module's ops for the whole process. :func:`load_prefix` executes only the part of the file
before the first registration (its kernels and host functions), as a module of its own.
"""
import pathlib
import sys
import types


def load_prefix(path, name: str, package: str, stop: str) -> types.ModuleType:
    """The source of ``path`` up to the line starting ``stop`` (its first op registration), run as the
    module ``name`` inside ``package`` (so its relative imports resolve against the installed one)."""
    src = pathlib.Path(path).read_text()
    mod = types.ModuleType(name)
    mod.__package__, mod.__file__ = package, str(path)
    sys.modules[name] = mod  # triton's JIT looks its functions' globals up through the module
    exec(compile(src[: src.index(stop)], str(path), "exec"), mod.__dict__)
    return mod
