"""The service: one process that syncs every folder the user registered, and the
local web page and REST API that show and steer it (docs/app.md, docs/api.md)."""
