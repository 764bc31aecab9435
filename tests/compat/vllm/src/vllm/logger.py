"""pinstage compat shim, not vLLM code: vllm.logger: standard logging with vLLM's *_once methods."""

import functools
import logging


class _Logger(logging.LoggerAdapter):
    @functools.lru_cache(maxsize=None)  # noqa: B019
    def _once(self, level: int, msg: str, *args: object) -> None:
        self.log(level, msg, *args)

    def warning_once(self, msg: str, *args: object) -> None:
        self._once(logging.WARNING, msg, *args)

    def info_once(self, msg: str, *args: object) -> None:
        self._once(logging.INFO, msg, *args)

    def debug_once(self, msg: str, *args: object) -> None:
        self._once(logging.DEBUG, msg, *args)


def init_logger(name: str) -> _Logger:
    return _Logger(logging.getLogger(name), {})
