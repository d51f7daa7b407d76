"""What a person sees: metrics (workers), the layout files (rank 0), progress lines, and
``ray-mesh status`` (driver). Modules that need Ray import it lazily, inside functions.
"""
