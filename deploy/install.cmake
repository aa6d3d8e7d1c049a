# `make install` and the Debian package (`make deb`, CPack DEB). Included
# from the top CMakeLists.txt after every folder, so the install() rules of
# the others (man pages, bash completion) are in the package too.
include(GNUInstallDirs)

# Where the units go: relative paths are under CMAKE_INSTALL_PREFIX
# (/usr/local/lib/systemd/system for a plain `make install`, which systemd
# reads too); the package passes /lib/systemd/system.
set(KSCORE_SYSTEMD_UNITDIR "lib/systemd/system"
    CACHE STRING "where `make install` puts the systemd units")
# The configuration directory the units name: /etc/kscore for prefix /usr,
# <prefix>/etc/kscore otherwise (GNUInstallDirs' rule).
set(KSCORE_CONFDIR "${CMAKE_INSTALL_FULL_SYSCONFDIR}/kscore")
set(KSCORE_BINDIR "${CMAKE_INSTALL_FULL_BINDIR}")
# kscore-daemon, the daemon half kscore runs (cli/CMakeLists.txt).
set(KSCORE_LIBEXECDIR "${CMAKE_INSTALL_FULL_LIBEXECDIR}/kscore")
# kscore-stack.service's environment file (KSCORE_UP_ARGS): /etc/default.
set(KSCORE_DEFAULTDIR "${CMAKE_INSTALL_FULL_SYSCONFDIR}/default")

if(TARGET kscore)
  get_target_property(_ks_type kscore TYPE)
  if(_ks_type STREQUAL "EXECUTABLE")
    install(TARGETS kscore RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
    # The daemon half (cli_int.h): kscore runs it for `kscore broker`,
    # `kscore agent`, `kscore up` ...; found from bindir by KSCORE_DAEMON_REL.
    install(TARGETS kscore-daemon
            RUNTIME DESTINATION ${CMAKE_INSTALL_LIBEXECDIR}/kscore)
  endif()
endif()

foreach(unit kscore-broker.service kscore-agent.service kscore-stack.service
             kscore-stack-watch.service kscore-stack-watch.timer)
  configure_file(${CMAKE_SOURCE_DIR}/deploy/systemd/${unit}.in
                 ${CMAKE_BINARY_DIR}/deploy/${unit} @ONLY)
  install(FILES ${CMAKE_BINARY_DIR}/deploy/${unit}
          DESTINATION ${KSCORE_SYSTEMD_UNITDIR})
endforeach()

# Example configs: conffiles in the package (dpkg keeps local edits), and
# never overwritten by a later `make install`.
foreach(conf broker.conf agent.conf)
  install(CODE "
    set(_dst \"\$ENV{DESTDIR}${KSCORE_CONFDIR}/${conf}\")
    if(EXISTS \"\${_dst}\" AND \"\$ENV{DESTDIR}\" STREQUAL \"\")
      message(STATUS \"Kept: \${_dst} (the example is ${CMAKE_SOURCE_DIR}/deploy/etc/${conf})\")
    else()
      file(INSTALL \"${CMAKE_SOURCE_DIR}/deploy/etc/${conf}\"
           DESTINATION \"${KSCORE_CONFDIR}\"
           PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ)
    endif()")
endforeach()
# kscore-stack.service's arguments: no secret in it, 0644 as /etc/default
# files are; a conffile too.
install(CODE "
  set(_dst \"\$ENV{DESTDIR}${KSCORE_DEFAULTDIR}/kscore-stack\")
  if(EXISTS \"\${_dst}\" AND \"\$ENV{DESTDIR}\" STREQUAL \"\")
    message(STATUS \"Kept: \${_dst} (the example is ${CMAKE_SOURCE_DIR}/deploy/etc/default/kscore-stack)\")
  else()
    file(INSTALL \"${CMAKE_SOURCE_DIR}/deploy/etc/default/kscore-stack\"
         DESTINATION \"${KSCORE_DEFAULTDIR}\"
         PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ)
  endif()")

# ---- Debian package --------------------------------------------------------
set(CPACK_GENERATOR "DEB")
set(CPACK_PACKAGE_NAME "kscore")
set(CPACK_PACKAGE_VERSION "0.1.0")
set(CPACK_PACKAGE_CONTACT "kscore maintainers <kscore@localhost>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "event-sourced command dispatch broker and agent")
set(CPACK_PACKAGE_DESCRIPTION
    "kscore runs commands on one host or a fleet: the broker records every\nstep in PostgreSQL and dispatches signed commands over NATS JetStream;\nthe agent runs them under a kill protocol and reports back. The operator's\nkscore and its daemon half (broker, agent, local stack), with systemd units.")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION "admin")
set(CPACK_DEBIAN_PACKAGE_PRIORITY "optional")
# The libraries the binary links (libnats, libpq, libprotobuf-c, ...), found
# by dpkg-shlibdeps; passwd for useradd/groupadd in postinst.
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "passwd")
# A broker host needs nats-server and PostgreSQL (here or reachable); an
# agent host needs neither, and `kscore up` (the local stack) needs both.
set(CPACK_DEBIAN_PACKAGE_SUGGESTS "nats-server, postgresql")
set(CPACK_PACKAGING_INSTALL_PREFIX "${CMAKE_INSTALL_PREFIX}")
# Staged with DESTDIR, so the absolute paths (/etc/kscore, the units) land
# in the package, not on this machine.
set(CPACK_SET_DESTDIR ON)
# Control files: the maintainer scripts, and the conffiles (dpkg keeps an
# administrator's edits across upgrades and removes them on purge only).
set(_ks_ctl ${CMAKE_BINARY_DIR}/deploy/debian)
file(MAKE_DIRECTORY ${_ks_ctl})
file(WRITE ${_ks_ctl}/conffiles
     "${KSCORE_CONFDIR}/broker.conf\n${KSCORE_CONFDIR}/agent.conf\n${KSCORE_DEFAULTDIR}/kscore-stack\n")
foreach(s postinst prerm postrm)
  file(COPY ${CMAKE_SOURCE_DIR}/deploy/debian/${s} DESTINATION ${_ks_ctl}
       FILE_PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE GROUP_READ
                        GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
endforeach()
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA
    "${_ks_ctl}/conffiles;${_ks_ctl}/postinst;${_ks_ctl}/prerm;${_ks_ctl}/postrm")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION TRUE)
# `make deb` builds the binary only; the package does not need the tests.
set(CMAKE_SKIP_INSTALL_ALL_DEPENDENCY TRUE)
include(CPack)
