"""The engines: the embedded one (``embedded/``), their clients (``clients/``), new weights to them
(``weights/``), and what these share: SGLang's protocol (``protocol``), image payloads (``images``), the
HTTP transport (``http``), and starting engine processes (``launch``: the embedded engine, SGLang,
vLLM, the router)."""
