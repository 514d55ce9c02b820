"""``streamrl view``: a local web page of one run, read from its Redis like ``streamrl status``.

``app`` holds the Starlette app and its routes; ``feed`` the live reward-by-version feed;
``browse`` the bounded reads of the trajectory browser; ``conversation`` turns an episode's
Responses items into what the templates show. Needs the ``view`` extra (Starlette, uvicorn,
Jinja2, sse-starlette); the chart is uPlot, vendored under ``static/`` with its licence.
"""
