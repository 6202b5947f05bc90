"""``trainproof digest URL``: the digest of a Hugging Face model directory, to declare as pretrained weights
(trainproof.train.model_dir)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from trainproof.cli.app import app
from trainproof.cli.common import EndpointArg, PathStyleArg, RegionArg, fail, handled, setup_logging
from trainproof.errors import TrainError
from trainproof.storage import StoreOptions


@app.command("digest")
@handled
def digest_command(
    url: Annotated[str, typer.Argument(help="The model directory: a folder, file:///path or s3://bucket/prefix.")],
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Read every file of the Hugging Face model directory at URL, hashing it, and write its listing
    (trainproof-listing.json: each file's name, size and sha256) there, create-only; print the directory's digest
    (the listing's sha256), what a task declares as Pretrained(url=URL, digest=...). Run again, it reads every file
    and checks them against the listing there. Exit 0; 2 for a folder that is not a model directory (a subfolder or
    a link in it, no weights, an index naming a file it does not hold); 1 when the listing there does not list the
    files (one line naming the first that differs) or a storage failure."""
    setup_logging()
    try:
        from trainproof.train.model_dir import seal

        sealed = seal(url, StoreOptions.from_env(endpoint_url=endpoint_url, region=region, path_style=path_style))
    except TrainError as exc:
        raise fail(str(exc), exc.exit_code) from None
    print(json.dumps(sealed))
