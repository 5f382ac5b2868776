module pcc.local/e2e-pause

go 1.22
