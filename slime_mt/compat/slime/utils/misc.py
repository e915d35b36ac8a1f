"""slime.utils.misc: ``load_function`` (slime_mt's loader: ``pkg.mod.fn`` or ``file.py:fn``) and
``SingletonMeta``."""

from slime_mt.plugins import load_function as _load


def load_function(path: str):
    return _load(path)


class SingletonMeta(type):
    """One instance per class."""

    _instances: dict = {}

    def __call__(cls, *args, **kwargs):
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]
