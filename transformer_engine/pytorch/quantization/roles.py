"""Tensor roles of the GEMMs of a module and their slots in the scaling state (TE's index constants).

Forward state: 3 slots per GEMM, in the order input, weight, output (GEMM1_INPUT = 0, GEMM1_WEIGHT = 1,
GEMM1_OUTPUT = 2, GEMM2_INPUT = 3, ...). Backward state: 2 slots per GEMM, grad output then grad input
(GRAD_OUTPUT1 = 0, GRAD_INPUT1 = 1, GRAD_OUTPUT2 = 2, ...). A module with several GEMMs (LayerNormMLP:
fc1 = GEMM1, fc2 = GEMM2) continues the pattern per GEMM.
"""

from __future__ import annotations

import enum

__all__ = ["FP8BwdTensors", "FP8FwdTensors", "Role", "BWD_ROLES", "FWD_ROLES", "slot"]


class Role(enum.Enum):
    """The tensor roles of one GEMM."""

    INPUT = "input"
    WEIGHT = "weight"
    OUTPUT = "output"
    GRAD_OUTPUT = "grad_output"
    GRAD_INPUT = "grad_input"


FWD_ROLES = (Role.INPUT, Role.WEIGHT, Role.OUTPUT)
BWD_ROLES = (Role.GRAD_OUTPUT, Role.GRAD_INPUT)


def slot(gemm: int, role: Role) -> int:
    """Index of ``role`` of GEMM number ``gemm`` (0-based) in its direction's state: 3g + r or 2g + r."""
    roles = FWD_ROLES if role in FWD_ROLES else BWD_ROLES
    return len(roles) * gemm + roles.index(role)


class FP8FwdTensors(enum.IntEnum):
    """TE's forward slot constants (``tex.FP8FwdTensors``)."""

    GEMM1_INPUT = 0
    GEMM1_WEIGHT = 1
    GEMM1_OUTPUT = 2
    GEMM2_INPUT = 3
    GEMM2_WEIGHT = 4
    GEMM2_OUTPUT = 5
    GEMM3_INPUT = 6
    GEMM3_WEIGHT = 7
    GEMM3_OUTPUT = 8


class FP8BwdTensors(enum.IntEnum):
    """TE's backward slot constants (``tex.FP8BwdTensors``)."""

    GRAD_OUTPUT1 = 0
    GRAD_INPUT1 = 1
    GRAD_OUTPUT2 = 2
    GRAD_INPUT2 = 3
    GRAD_OUTPUT3 = 4
    GRAD_INPUT3 = 5
