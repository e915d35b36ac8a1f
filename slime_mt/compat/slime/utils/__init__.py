"""slime.utils: types, http_utils, misc, processing_utils, async_utils."""
