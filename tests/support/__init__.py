"""What several test modules share: the oracle client, fake backends, KV-event publishers."""
