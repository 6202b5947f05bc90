"""Reusable test infrastructure (not collected as tests).

- :mod:`tests.support.s3server` -- moto's S3 server on loopback, with boto3/s3fs client helpers.
- :mod:`tests.support.faultproxy` -- a loopback HTTP reverse proxy that injects S3-style faults
  (503 SlowDown, 500, 403, connection resets, stalls, "write landed but response lost").

Import as ``from tests.support.s3server import S3Server`` (the repository root must be on
``sys.path``: ``python -m pytest`` from the root does that).
"""
