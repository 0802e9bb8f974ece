"""ZeRO partitioning: stages 1-2 here (``stage_1_and_2``), stage 3 in ``zero.stage3``.

Import the submodules directly; this package imports nothing eagerly so that each stage
loads only what it needs.
"""
