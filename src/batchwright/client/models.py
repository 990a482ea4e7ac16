"""`batchwright models list` against a running service."""

from __future__ import annotations

import typer

from batchwright.client.common import ApiKey, BaseUrl, Json, connect, handled, print_json, table

app = typer.Typer(help="Models a running service serves.", no_args_is_help=True)


@app.command("list")
@handled
def list_models(base_url: BaseUrl = None, api_key: ApiKey = None, as_json: Json = False) -> None:
    """List the models the service can run, with the workers live for each now."""
    models = list(connect(base_url, api_key).models.list())
    if as_json:
        print_json(models)
        return
    # `live_workers` is batchwright's own field (the SDK keeps it as an extra); 0 means
    # batches of that model wait and online requests are refused until a worker starts.
    table(
        ["id", "live workers", "owned by"],
        [(m.id, (m.model_extra or {}).get("live_workers"), m.owned_by) for m in models],
    )
