"""What the engine needs of torch and the process: the device, torch.compile with a
fallback, host memory."""
