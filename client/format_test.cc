#include "client/format.h"

#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(RenderTable, PadsColumnsToTheWidestCell) {
  EXPECT_EQ(RenderTable({"A", "BB"}, {{"xxx", "y"}, {"z", "wwww"}}),
            "A    BB\n"
            "xxx  y\n"
            "z    wwww\n");
}

TEST(RenderWorkersTable, ShowsDeviceStateAndHeartbeatAge) {
  v1::Worker w;
  w.mutable_info()->set_worker_id("worker-000001");
  w.mutable_info()->set_address("127.0.0.1:7071");
  w.mutable_info()->set_host("node1");
  w.mutable_info()->set_device_kind(v1::DEVICE_KIND_CUDA);
  w.mutable_info()->set_device_ordinal(3);
  w.mutable_info()->set_device_name("H100");
  w.set_state(v1::WORKER_STATE_IDLE);
  w.mutable_last_heartbeat_time()->set_seconds(1000);
  const std::string table = RenderWorkersTable({w}, absl::FromUnixSeconds(1002));
  EXPECT_EQ(table,
            "ID             ADDRESS         HOST   DEVICE         STATE  LAST HEARTBEAT\n"
            "worker-000001  127.0.0.1:7071  node1  cuda:3 (H100)  idle   2.0s ago\n");
}

TEST(RenderJson, UsesProto3JsonNames) {
  v1::Worker w;
  w.mutable_info()->set_worker_id("worker-000001");
  w.set_state(v1::WORKER_STATE_LOST);
  auto json = RenderJson(w, /*pretty=*/false);
  ASSERT_TRUE(json.ok());
  EXPECT_NE(json->find("\"workerId\":\"worker-000001\""), std::string::npos) << *json;
  EXPECT_NE(json->find("\"state\":\"WORKER_STATE_LOST\""), std::string::npos) << *json;
}

}  // namespace
}  // namespace colod
