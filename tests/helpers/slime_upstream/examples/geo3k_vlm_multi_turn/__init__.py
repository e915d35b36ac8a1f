# Multi-turn VLM Sokoban example package
