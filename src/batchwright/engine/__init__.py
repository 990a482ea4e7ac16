"""Generation engine. Importing this package imports torch: never from the API process."""
