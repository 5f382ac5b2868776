from pcc_plugin.main import main

main()
