"""The MIL executor: runs a saved ML Program on any OS (stands on the saved program alone, never on our graph code)."""
