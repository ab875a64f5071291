"""Process plumbing shared by every entry point: logging, the one exit wrapper, free ports."""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable

from asyncrl.config.fields import ConfigError

EXIT_CONFIG = 2


def setup_logging(process: str, level: int = logging.INFO) -> logging.Logger:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s {process} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    quiet_libraries()
    # transformers prints progress bars and advice on every load; keep process logs readable
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return logging.getLogger(f"asyncrl.{process}")


def quiet_libraries() -> None:
    """The HTTP and agent libraries' loggers at WARNING: one INFO line per request otherwise (httpx's per
    request, verifiers' two per episode, its interception server's one per turn: tens of thousands in an
    eval's log)."""
    for noisy in ("httpx", "httpcore", "openai", "verifiers", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class ProcessFailed(RuntimeError):
    """A child process died or never became ready; the message names it and its log (no traceback needed)."""


def exit_wrapper(process: str) -> Callable:
    """Run ``fn`` and turn its outcome into an exit code: 0 ok, 2 bad config, 130 interrupted, 1 error.

    The traceback goes to stderr, which ``asyncrl rl`` captures in ``logs/<process>.log``.
    """

    def deco(fn: Callable[..., None]) -> Callable[..., int]:
        @functools.wraps(fn)
        def wrapped(*args, **kwargs) -> int:
            try:
                fn(*args, **kwargs)
                return 0
            except ConfigError as e:
                print(f"error: {e}", file=sys.stderr)
                return EXIT_CONFIG
            except KeyboardInterrupt:
                print(f"{process}: interrupted", file=sys.stderr)
                return 130
            except ProcessFailed as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            except Exception:  # the process boundary: log everything, exit non-zero
                traceback.print_exc()
                print(f"{process}: failed (see the traceback above)", file=sys.stderr)
                return 1

        return wrapped

    return deco


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
