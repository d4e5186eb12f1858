"""kvq triton_repo package."""
