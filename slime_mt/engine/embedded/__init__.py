"""The embedded engine (``--engine local``): an HTTP server that speaks SGLang's API (``server``), its
scheduler of running requests (``scheduler``), the model side (``runner``: prefill, batched decode,
sampling, weight loads) and the prefix cache of finished contexts (``prefix_cache``)."""
