"""``stopline console``: the web console (needs the ``console`` extra).

from stopline.console import ConsoleConfig, create_app
app = create_app(ConsoleConfig(url="sqlite:///stopline.db", token="secret"))
"""

from __future__ import annotations

from stopline.console.app import ConsoleConfig, create_app

__all__ = ["ConsoleConfig", "create_app", "serve"]


def serve(
    url: str, *, host: str = "127.0.0.1", port: int = 8765, token: str, principal: str | None
) -> None:
    """Serve until Ctrl-C (uvicorn)."""
    import uvicorn

    app = create_app(ConsoleConfig(url=url, token=token, principal=principal))
    uvicorn.run(app, host=host, port=port, log_level="warning", ws="none", lifespan="on")
