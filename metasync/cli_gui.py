"""``metasync gui``: open the running service's page in a browser, signed in.

The address carries a one-time login token (:func:`metasync.app.auth.make_token`)
made here from the API key in the user's config folder, so nothing is asked of
the service: the page's ``/login`` takes the token once, within minutes, and
answers with a session cookie (docs/api.md, "Authentication").
"""

from __future__ import annotations

import urllib.parse
import webbrowser

import click

from metasync.app.auth import make_token
from metasync.app.registry import Registry
from metasync.cli_common import _fail


def login_url(registry: Registry) -> str | None:
    """The running service's page address with a fresh login token; None if no
    service runs for this config folder."""
    running = registry.read_running()
    if running is None:
        return None
    host = str(running["host"])
    if host in ("", "0.0.0.0", "localhost"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = "[::1]" if host in ("::", "::1") else f"[{host}]"
    token = urllib.parse.quote(make_token(registry.api_key()), safe="")
    return f"http://{host}:{running['port']}/login?token={token}"


@click.command()
@click.option("--print", "print_only", is_flag=True,
              help="Print the page's address (valid once, for two minutes) instead of "
                   "opening a browser.")
def gui(print_only: bool) -> None:
    """Open the web page of the running service (`metasync service`), signed in."""
    url = login_url(Registry())
    if url is None:
        _fail("no metasync service is running for this user; start it with "
              "`metasync service` (or `metasync install-service`)")
    if print_only or not webbrowser.open(url):
        click.echo(url)
