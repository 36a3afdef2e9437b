"""Argument types shared by the console scripts (``argparse`` ``type=``): a bad value is a usage
error naming the option, exit status 2."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value
