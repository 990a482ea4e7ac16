"""`batchwright models list` against a running service."""

from __future__ import annotations

import typer

from batchwright.client.common import ApiKey, BaseUrl, Json, connect, handled, print_json, table

app = typer.Typer(help="Models a running service serves.", no_args_is_help=True)


@app.command("list")
@handled
def list_models(base_url: BaseUrl = None, api_key: ApiKey = None, as_json: Json = False) -> None:
    """List the models the service can run."""
    models = list(connect(base_url, api_key).models.list())
    if as_json:
        print_json(models)
        return
    table(["id", "owned by"], [(m.id, m.owned_by) for m in models])
