#!/bin/bash
echo 5 > /app/sum.txt
