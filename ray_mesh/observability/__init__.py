"""What a person sees: metrics (workers), the layout files (rank 0), progress lines, the hang
watch (every rank; ``hang``, Ray-free), ``ray-mesh status`` (driver) and its HTML picture
(``html``, Ray-free). Modules that need Ray import it lazily, inside functions.
"""
