#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "kmsg.h"

TEST(Kmsg, ParsesDevKmsgRecordWithPid) {
  auto x = watchdog::parse_kmsg_line(
      "4,1234,5678901,-;NVRM: Xid (PCI:0000:00:06): 31, pid=684, name=python3, Ch 00000008, "
      "intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f1_23456000.");
  ASSERT_TRUE(x);
  EXPECT_EQ(x->xid, 31);
  EXPECT_EQ(x->pid, 684);
  EXPECT_EQ(x->pci, "0000:00:06");
  EXPECT_EQ(x->name, "python3");
}

TEST(Kmsg, ParsesWithoutPid) {
  auto x = watchdog::parse_kmsg_line("NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.");
  ASSERT_TRUE(x);
  EXPECT_EQ(x->xid, 79);
  EXPECT_EQ(x->pid, 0);
  auto y = watchdog::parse_kmsg_line("NVRM: Xid (PCI:0000:10:1c): 63, pid='<unknown>', name=<unknown>, "
                                "Row Remapper: New row marked for remapping");
  ASSERT_TRUE(y);
  EXPECT_EQ(y->xid, 63);
  EXPECT_EQ(y->pid, 0);
}

TEST(Kmsg, RejectsOtherLines) {
  EXPECT_FALSE(watchdog::parse_kmsg_line("6,1,2,-;usb 1-1: new high-speed USB device"));
  EXPECT_FALSE(watchdog::parse_kmsg_line("NVRM: Xid (PCI:0000:00:06): notanumber"));
  EXPECT_FALSE(watchdog::parse_kmsg_line("NVRM: Xid (PCI:0000:00:06"));
  EXPECT_FALSE(watchdog::parse_kmsg_line(""));
}

TEST(Kmsg, ReaderSeesOnlyNewLinesAndMatchesByXid) {
  char path[] = "/tmp/kmsg_test_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  {
    std::ofstream f(path);
    f << "NVRM: Xid (PCI:0000:00:06): 31, pid=1, name=old\n";  // before open: ignored
  }
  watchdog::KmsgReader r;
  ASSERT_EQ(r.open(path), 0);
  {
    std::ofstream f(path, std::ios::app);
    f << "NVRM: Xid (PCI:0000:00:06): 13, pid=42, name=a\n"
      << "unrelated\n"
      << "NVRM: Xid (PCI:0000:00:06): 31, pid=43, na";
  }
  r.poll(1000);
  EXPECT_FALSE(r.take(31, "", 1000, 5000));  // line not finished yet
  {
    std::ofstream f(path, std::ios::app);
    f << "me=b\n";
  }
  r.poll(1100);
  auto x = r.take(31, "", 1100, 5000);
  ASSERT_TRUE(x);
  EXPECT_EQ(x->pid, 43);
  EXPECT_FALSE(r.take(31, "", 1100, 5000));  // taken once
  EXPECT_FALSE(r.take(13, "", 9000, 5000));  // too old
  std::remove(path);
}

TEST(Kmsg, PciKeysMatchAcrossFormats) {
  EXPECT_EQ(watchdog::pci_key("0000:06:00"), "06:00");
  EXPECT_EQ(watchdog::pci_key("00000000:06:00.0"), "06:00");
  EXPECT_EQ(watchdog::pci_key("0000:2B:00"), "2b:00");
  EXPECT_EQ(watchdog::pci_key(""), "");
}

TEST(Kmsg, TakeSkipsRecordsOfOtherDevices) {
  char path[] = "/tmp/kmsg_test_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  watchdog::KmsgReader r;
  ASSERT_EQ(r.open(path), 0);
  {
    std::ofstream f(path, std::ios::app);
    f << "NVRM: Xid (PCI:0000:06:00): 31, pid=60, name=a\n"
      << "NVRM: Xid (PCI:0000:07:00): 31, pid=70, name=b\n";
  }
  r.poll(0);
  auto six = r.take(31, "00000000:06:00.0", 0, 5000);
  ASSERT_TRUE(six);
  EXPECT_EQ(six->pid, 60);
  EXPECT_FALSE(r.take(31, "00000000:06:00.0", 0, 5000));
  auto any = r.take(31, "", 0, 5000);  // no address known: any record of that XID
  ASSERT_TRUE(any);
  EXPECT_EQ(any->pid, 70);
  std::remove(path);
}
